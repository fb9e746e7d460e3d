"""Process orchestration: scheduler, detokenizer and API server, each in its own process.

    launcher (this process: starts, watches, stops)
      |- scheduler     model + KV pool; steps batches              minisgl.server.scheduler_proc
      |- detokenizer   token ids -> text, stop strings             minisgl.server.detokenizer_proc
      |- api server    FastAPI + uvicorn, tokenizes prompts        minisgl.server.api

All three start at once (the API server pings the scheduler until the model is loaded). The
launcher logs one line once every child reports ready; if any child dies it stops the others and
exits non-zero; SIGTERM / Ctrl-C stop everything and remove the private socket folder.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.config import ServerArgs
from minisgl.message import Endpoints
from minisgl.models.resolve import resolve_model_path_for
from minisgl.server.model_names import served_model_name
from minisgl.server.process import child_main, setup_logging

logger = logging.getLogger("minisgl")

# Loading a large checkpoint can take minutes; this only bounds a start that never finishes.
STARTUP_TIMEOUT_S = 3600.0
WATCH_INTERVAL_S = 0.2
# SIGTERM'd children get this long to exit before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0
CHILD_FAILED_EXIT_CODE = 1
EXIT_CODE_WAIT_S = 1.0


class StackError(RuntimeError):
    pass


@dataclass
class _Child:
    name: str
    process: BaseProcess
    conn: Connection  # the launcher's end: ("ready", info) or ("error", message)
    ready: bool = False


class ServerStack:
    """The server's processes. `start`, then `wait_ready`, then `watch`; always `shutdown`."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.endpoints: Endpoints | None = None
        self._children: list[_Child] = []
        self._stop_requested = False

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def request_stop(self) -> None:
        """Safe to call from a signal handler: the wait loops notice within WATCH_INTERVAL_S."""
        self._stop_requested = True

    def start(self) -> None:
        try:
            model_path = str(resolve_model_path_for(self.args))  # converts the default once
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise StackError(str(exc)) from None
        tokenizer_path = self.args.tokenizer or model_path
        self.endpoints = endpoints = Endpoints.create()
        ctx = mp.get_context("spawn")  # torch state does not survive fork safely
        # Targets by name: the launcher itself never imports torch, transformers or FastAPI.
        targets: list[tuple[str, str, tuple[Any, ...]]] = [
            (
                "sched",
                "minisgl.server.scheduler_proc:run_scheduler_process",
                (self.args, endpoints),
            ),
            (
                "detok",
                "minisgl.server.detokenizer_proc:run_detokenizer_process",
                (tokenizer_path, endpoints),
            ),
            ("api", "minisgl.server.api:run_api_server", (self.args, endpoints, tokenizer_path)),
        ]
        for name, target, args in targets:
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=child_main,
                args=(name, target, child_conn, self.args.log_level, endpoints.root, *args),
                name=f"minisgl-{name}",
            )
            process.start()
            child_conn.close()  # the child holds its own copy; EOF here means the child is gone
            self._children.append(_Child(name, process, parent_conn))

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        while not all(child.ready for child in self._children):
            if self._stop_requested:
                raise StackError("stopped during startup")
            if time.monotonic() > deadline_s:
                raise StackError(f"server did not start within {timeout_s:.0f} s")
            pending = {child.conn: child for child in self._children if not child.ready}
            for conn in wait(list(pending), timeout=WATCH_INTERVAL_S):
                child = pending[conn]  # type: ignore[index]
                try:
                    kind, payload = child.conn.recv()
                except (EOFError, OSError):
                    child.process.join(timeout=EXIT_CODE_WAIT_S)  # for the exit code
                    raise StackError(
                        f"{child.name} exited during startup (exit code {child.process.exitcode})"
                    ) from None
                if kind == "error":
                    raise StackError(str(payload))
                child.ready = True

    def watch(self) -> int:
        """Block until a stop is requested (0) or any child exits (non-zero)."""
        sentinels = {child.process.sentinel: child for child in self._children}
        while not self._stop_requested:
            for sentinel in wait(list(sentinels), timeout=WATCH_INTERVAL_S):
                child = sentinels[sentinel]  # type: ignore[index]
                logger.error(
                    "%s exited unexpectedly (exit code %s); shutting down",
                    child.name,
                    child.process.exitcode,
                )
                return CHILD_FAILED_EXIT_CODE
        return 0

    def shutdown(self) -> None:
        # API server first: stop taking requests; then the workers behind it.
        for child in self._children:
            if child.process.is_alive():
                child.process.terminate()
        deadline_s = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for child in self._children:
            child.process.join(timeout=max(0.0, deadline_s - time.monotonic()))
            if child.process.is_alive():
                logger.warning("%s did not stop in time; killing it", child.name)
                child.process.kill()
                child.process.join()
            child.conn.close()
        self._children.clear()
        if self.endpoints is not None:
            self.endpoints.remove()


def serve(args: ServerArgs) -> int:
    """Run the server until SIGTERM / Ctrl-C; the return value is the process exit code."""
    setup_logging(args.log_level)
    stack = ServerStack(args)
    previous = {
        sig: signal.signal(sig, lambda *_: stack.request_stop())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        stack.start()
        stack.wait_ready()
        logger.info("minisgl serving %s at %s", served_model_name(args), stack.url)
        return stack.watch()
    except StackError as exc:
        if stack._stop_requested:
            return 0
        logger.error("server failed to start: %s", exc)
        return CHILD_FAILED_EXIT_CODE
    finally:
        stack.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
