"""Launching a server: the scheduler, detokenizer and API server, each in its own process (a
child of minisgl.runtime.supervisor), all started at once. The launcher logs one line once
every child is ready; if any child dies it stops the others and exits non-zero; SIGTERM /
Ctrl-C drain the API server, stop everything and remove the private socket folder."""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from minisgl.config import ServerArgs
from minisgl.models.names import served_model_name
from minisgl.models.resolve import resolve_model_path_for
from minisgl.runtime.messages import Endpoints
from minisgl.runtime.stages import stage
from minisgl.runtime.supervisor import (
    BACKEND_FAILED_SIGNAL,
    WATCH_INTERVAL_S,
    Children,
    StartupError,
    setup_logging,
)

if TYPE_CHECKING:
    from minisgl.runtime.dp import DataParallelStack

logger = logging.getLogger("minisgl")

# Loading a large checkpoint can take minutes; this only bounds a start that never finishes.
STARTUP_TIMEOUT_S = 3600.0
# SIGTERM'd children get this long to exit before they are killed (the API server gets it on top
# of its drain, --shutdown-timeout).
STOP_GRACE_S = 10.0
CHILD_FAILED_EXIT_CODE = 1
SCHEDULER_TARGET = "minisgl.scheduler.process:run_scheduler_process"
DETOKENIZER_TARGET = "minisgl.runtime.detokenizer_proc:run_detokenizer_process"
API_TARGET = "minisgl.api.app:run_api_server"
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def http_url(host: str, port: int) -> str:
    """A URL to reach a server listening on host:port (a wildcard listens on loopback too)."""
    host = WILDCARD_HOSTS.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class StopRequests:
    """How many times SIGTERM / Ctrl-C asked a stack (`run_until_stopped` drives one) to stop.
    `request_stop` is safe in a signal handler: the wait loops notice within WATCH_INTERVAL_S;
    a second call while the API server drains makes it abort what is left at once."""

    num_stop_requests = 0

    @property
    def stop_requested(self) -> bool:
        return self.num_stop_requests > 0

    def request_stop(self) -> None:
        self.num_stop_requests += 1


class ServerStack(StopRequests):
    """The server's processes. `start`, then `wait_ready`, then `watch`; always `shutdown`."""

    def __init__(self, args: ServerArgs, replica: int | None = None) -> None:
        self.args = args
        self.replica = replica  # its index with --dp (minisgl.runtime.dp)
        self.url = http_url(args.host, args.port)
        self.endpoints: Endpoints | None = None
        self.children = Children()

    def start(self) -> None:
        try:
            with stage("finding the model files"):  # converts the default once
                model_path = str(resolve_model_path_for(self.args))
        except (OSError, ValueError) as exc:  # FileNotFoundError included
            raise StartupError(str(exc)) from None
        tokenizer_path = self.args.tokenizer or model_path
        self.endpoints = endpoints = Endpoints.create()
        self.children = Children(log_level=self.args.log_level, cleanup_dir=endpoints.root)
        # Targets by name: the launcher itself never imports torch, transformers or FastAPI.
        # With --dp, children are named per replica: sched0, api1, ...
        suffix = "" if self.replica is None else str(self.replica)
        spawn, args = self.children.spawn, self.args
        logger.info(
            "starting the scheduler, detokenizer and API processes (each imports torch and "
            "transformers first: ~5-15 s)"
        )
        spawn(f"sched{suffix}", SCHEDULER_TARGET, args, endpoints)
        spawn(f"detok{suffix}", DETOKENIZER_TARGET, tokenizer_path, endpoints)
        spawn(f"api{suffix}", API_TARGET, args, endpoints, tokenizer_path, model_path)

    def wait_ready(self) -> None:
        self.children.wait(
            lambda child: child.ready, STARTUP_TIMEOUT_S, lambda: self.stop_requested
        )

    def ready_message(self) -> str:
        return f"minisgl serving {served_model_name(self.args)} at {self.url}"

    def watch(self) -> int:
        """Block until a stop is requested (0) or any child exits (non-zero)."""
        while not self.stop_requested:
            # Waits up to WATCH_INTERVAL_S; a child that exits, or reports, ends the wait early.
            if (failure := self.children.failure(wait_s=WATCH_INTERVAL_S)) is not None:
                logger.error("%s; shutting down", failure)
                return CHILD_FAILED_EXIT_CODE
        return 0

    def _stop_api_server(self, backend_failed: bool) -> None:
        """SIGTERM (drain) or BACKEND_FAILED_SIGNAL to the API server; wait for it to exit.
        While it drains, a worker dying or another stop request cuts the drain short."""
        processes = [c.process for c in self.children.members]
        if len(processes) < 3 or not processes[-1].is_alive():  # the API server starts last
            return
        *workers, api = processes
        assert api.pid is not None
        drain_s = 0.0 if backend_failed else self.args.shutdown_timeout_s
        deadline_s = time.monotonic() + drain_s + STOP_GRACE_S
        os.kill(api.pid, BACKEND_FAILED_SIGNAL if backend_failed else signal.SIGTERM)
        num_stops_seen = self.num_stop_requests
        while api.is_alive() and time.monotonic() < deadline_s:
            wait([p.sentinel for p in processes], timeout=WATCH_INTERVAL_S)
            if not backend_failed and not all(w.is_alive() for w in workers):
                backend_failed = True
                os.kill(api.pid, BACKEND_FAILED_SIGNAL)
            if self.num_stop_requests > num_stops_seen:  # asked again: stop waiting
                num_stops_seen = self.num_stop_requests
                api.terminate()

    def shutdown(self, backend_failed: bool = False) -> None:
        """Stop every child, front to back (see the module docstring); idempotent."""
        self._stop_api_server(backend_failed)
        self.children.stop(STOP_GRACE_S)
        if self.endpoints is not None:
            self.endpoints.remove()


def run_until_stopped(stack: ServerStack | DataParallelStack) -> int:
    """Start `stack` (a server, or the replicas of --dp), serve until SIGTERM / Ctrl-C or a
    failure, always shut it down; the return value is the process exit code."""
    setup_logging(stack.args.log_level)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stack.request_stop())
    exit_code = CHILD_FAILED_EXIT_CODE
    try:
        stack.start()
        stack.wait_ready()
        logger.info("%s", stack.ready_message())
        exit_code = stack.watch()
    except StartupError as exc:
        if stack.stop_requested:
            exit_code = 0
        else:
            logger.error("server failed to start: %s", exc)
    finally:
        stack.shutdown(backend_failed=exit_code != 0)
    return exit_code
