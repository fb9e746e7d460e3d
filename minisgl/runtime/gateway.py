"""The SGLang Model Gateway (PyPI `sglang-router`) as a child of `--dp`, run with this Python.
Its control plane (`/workers`) says when it has registered the replicas and takes a dead one
out of rotation. SIGINT is its graceful stop (in-flight requests finish); SIGTERM ends it at
once, and it gets SIGTERM when the launcher dies (supervisor.prepare_exec_child)."""

import http.client
import importlib.util
import json
import logging
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from minisgl.config import DataParallelArgs, ServerArgs
from minisgl.runtime.launch import STOP_GRACE_S, WILDCARD_HOSTS, http_url
from minisgl.runtime.supervisor import WATCH_INTERVAL_S, StartupError, prepare_exec_child

logger = logging.getLogger("minisgl")

GATEWAY_PACKAGE = "sglang_router"
GATEWAY_MODULE = "sglang_router.launch_router"
INSTALL_HINT = 'pip install sglang-router (or pip install -e ".[router]")'
# It registers workers in the background after it starts listening: wait this long for all.
READY_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 2.0
# Its own default (60 s) leaves a dead replica in rotation for minutes; on one machine probing
# every few seconds costs nothing. --router-args overrides it.
HEALTH_CHECK_INTERVAL_S = 5
# Our log levels -> the gateway's. It logs every request at info: keep it to warnings.
LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


def gateway_installed() -> bool:
    return importlib.util.find_spec(GATEWAY_PACKAGE) is not None


def gateway_command(args: ServerArgs, dp: DataParallelArgs, worker_urls: list[str]) -> list[str]:
    """`smg launch ...` in front of `worker_urls`; dp.router_args come last, so they win."""
    command = [
        *(sys.executable, "-m", GATEWAY_MODULE),
        *("--host", args.host, "--port", str(args.port)),
        *("--worker-urls", *worker_urls),
        *("--policy", dp.router_policy),
        # Its Prometheus port right after the replicas' (its default, 29000, would collide
        # between two launches on one machine).
        *("--prometheus-host", args.host, "--prometheus-port", str(args.port + dp.dp_size + 1)),
        *("--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S)),
        *("--shutdown-grace-period-secs", str(math.ceil(args.shutdown_timeout_s))),
        *("--log-level", LOG_LEVELS.get(args.log_level, "warn")),
    ]
    if args.api_key:  # clients present it to the gateway, which presents it to the replicas
        command += ["--api-key", args.api_key]
    return [*command, *dp.router_args]


class Gateway:
    """One gateway process in front of `worker_urls`; `start`, then `stop`."""

    def __init__(self, args: ServerArgs, dp: DataParallelArgs, worker_urls: list[str]) -> None:
        self.url = http_url(args.host, args.port)
        self._host = WILDCARD_HOSTS.get(args.host, args.host)  # where its control plane answers
        self._command = gateway_command(args, dp, worker_urls)
        self._urls = set(worker_urls)
        self._args = args
        self._process: subprocess.Popen | None = None

    @property
    def exit_code(self) -> int | None:
        """None while it runs (or before it starts)."""
        return None if self._process is None else self._process.poll()

    def start(self, stop_requested: Callable[[], bool]) -> None:
        """Start it and wait until it lists every worker as healthy."""
        self._process = subprocess.Popen(self._command, preexec_fn=prepare_exec_child)
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while not {w.get("url") for w in self._workers() if w.get("is_healthy")} >= self._urls:
            if stop_requested():
                raise StartupError("stopped during startup")
            if self.exit_code is not None:
                raise StartupError(f"the gateway exited (exit code {self.exit_code})")
            if time.monotonic() > deadline_s:
                raise StartupError(f"the gateway registered no replicas in {READY_TIMEOUT_S:.0f} s")
            time.sleep(WATCH_INTERVAL_S)

    def _control(self, path: str, method: str = "GET") -> dict[str, Any]:
        """A call to its control plane; {} when it does not answer (not listening yet, ...)."""
        conn = http.client.HTTPConnection(self._host, self._args.port, timeout=HTTP_TIMEOUT_S)
        headers = {"Authorization": f"Bearer {self._args.api_key}"} if self._args.api_key else {}
        try:
            conn.connect()
            # A probe of a port nobody listens on yet, in the kernel's ephemeral range, can get
            # that same port as its source and connect to itself (TCP self-connect): it would
            # read back its own request, and hold the port the gateway is about to bind.
            if conn.sock.getsockname() == conn.sock.getpeername():
                return {}
            conn.request(method, path, headers=headers)
            body = json.load(conn.getresponse())
        except (OSError, ValueError, http.client.HTTPException):
            return {}
        finally:
            conn.close()
        return body if isinstance(body, dict) else {}

    def _workers(self) -> list[dict[str, Any]]:
        workers = self._control("/workers").get("workers")
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []

    def remove_worker(self, url: str) -> None:
        """Best effort: out of rotation now, rather than when its health check notices (which
        then keeps probing the dead address)."""
        for worker in self._workers():
            if worker.get("url") == url and worker.get("id"):
                self._control(f"/workers/{worker['id']}", method="DELETE")

    def stop(self, hurry: Callable[[], bool]) -> None:
        """Graceful stop, bounded by --shutdown-timeout (plus a grace), or until `hurry()`."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        deadline_s = time.monotonic() + self._args.shutdown_timeout_s + STOP_GRACE_S
        while process.poll() is None and time.monotonic() < deadline_s and not hurry():
            time.sleep(WATCH_INTERVAL_S)
        if process.poll() is None:
            logger.warning("the gateway did not stop in time; killing it")
            process.kill()
        process.wait()
