"""Start and stop a real `python -m minisgl.server` for tests; read its /metrics."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from minisgl.api.metrics import EXPORTED_FIELDS, PREFIX
from minisgl.stats import METRIC

STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.25
# A small KV pool and context keep startup fast and memory low on 2 cores.
TEST_SERVER_FLAGS = ("--num-pages", "4096", "--max-model-len", "1024")
# Exported only when the scheduler runs on CUDA (dashboards show "no data" on CPU): the gauges
# that are None until the scheduler process fills them in.
GPU_METRIC_NAMES = frozenset(
    PREFIX + name
    for f in EXPORTED_FIELDS
    if f.default is None
    for name, _ in f.metadata[METRIC].names
)
PORT_RANGE_START = 10000
PORT_BLOCK_TRIES = 50
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_block(num_ports: int = 1) -> int:
    """A base port P with P .. P+num_ports-1 all free on 127.0.0.1 (--dp needs consecutive ones).

    Below the kernel's ephemeral range: a client that probes a port in that range before its
    server listens can be given the same port as its own source and connect to itself (TCP
    self-connect), which then keeps the server from binding it."""
    rng = random.Random()
    for _ in range(PORT_BLOCK_TRIES):
        base = rng.randrange(PORT_RANGE_START, _ephemeral_ports_start() - num_ports)
        sockets = []
        try:
            for port in range(base, base + num_ports):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no block of {num_ports} free ports found")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (comments skipped)."""
    values = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


class LocalEndpoint:
    """What tests ask of a server they started on 127.0.0.1: its URL, auth headers and log."""

    port: int
    api_key: str | None
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class ServerProcess(LocalEndpoint):
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    children: list[psutil.Process] = field(default_factory=list)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_INTERVAL_S)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10.0).text)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        for child in self.children:  # never leave strays behind, even when a test failed
            if alive(child):
                child.kill()
        self.log_path.unlink(missing_ok=True)
        return int(self.proc.returncode)


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_server(*extra_args: str, api_key: str | None = None) -> ServerProcess:
    port = free_port_block()
    fd, log_name = tempfile.mkstemp(prefix="minisgl-server-", suffix=".log")
    args = [sys.executable, "-m", "minisgl.server", "--port", str(port), *TEST_SERVER_FLAGS]
    if api_key:
        args += ["--api-key", api_key]
    with os.fdopen(fd, "wb") as log_file:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [*args, *extra_args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return ServerProcess(proc, port, Path(log_name), api_key)


@contextlib.contextmanager
def running_server(*extra_args: str, api_key: str | None = None) -> Iterator[ServerProcess]:
    """A healthy server for the block, stopped after it whatever happened (a module fixture is
    `with running_server(...) as srv: yield srv`)."""
    srv = start_server(*extra_args, api_key=api_key)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def require_default_model() -> Path:
    """The bundled default model's folder, converted once. It is part of the test setup
    (scripts/test.sh installs it): when it is missing or broken the calling test fails with
    the reason, it is never skipped."""
    from minisgl.models.resolve import resolve_model_path

    return resolve_model_path(None)


def openai_client(server: ServerProcess, timeout_s: float, api_key: str = "unused") -> Any:
    """The OpenAI SDK pointed at `server`, without retries (a retry would hide a failure)."""
    import openai

    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=api_key, timeout=timeout_s, max_retries=0
    )


IDLE_TIMEOUT_S = 30.0


def wait_idle(server: ServerProcess, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    """Wait until nothing runs or waits and every KV page is back (free, or evictable prefix
    cache); return the metrics seen then. Fails with the last metrics after `timeout_s`."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if (
            metrics["minisgl:num_running_reqs"] == 0
            and metrics["minisgl:num_queue_reqs"] == 0
            and metrics["minisgl:num_free_kv_pages"] == metrics["minisgl:num_total_kv_pages"]
        ):
            return metrics
        if time.monotonic() > deadline_s:
            raise AssertionError(f"server not idle after {timeout_s} s: {metrics}")
        time.sleep(POLL_INTERVAL_S)
