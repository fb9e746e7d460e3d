"""Process orchestration: scheduler, detokenizer and API server, each in its own process.

    launcher (this process: starts, watches, stops)
      |- scheduler     model + KV pool; steps batches              minisgl.runtime.scheduler_proc
      |- detokenizer   token ids -> text, stop strings             minisgl.runtime.detokenizer_proc
      |- api server    FastAPI + uvicorn, tokenizes prompts        minisgl.server.api

All three start at once (the API server pings the scheduler until the model is loaded). The
launcher logs one line once every child reports ready; if any child dies it stops the others and
exits non-zero; SIGTERM / Ctrl-C stop everything and remove the private socket folder.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from minisgl.config import ServerArgs
from minisgl.models.names import served_model_name
from minisgl.models.resolve import resolve_model_path_for
from minisgl.runtime.messages import Endpoints
from minisgl.runtime.supervisor import BACKEND_FAILED_SIGNAL, child_main, setup_logging

logger = logging.getLogger("minisgl")

# Loading a large checkpoint can take minutes; this only bounds a start that never finishes.
STARTUP_TIMEOUT_S = 3600.0
WATCH_INTERVAL_S = 0.2
# SIGTERM'd children get this long to exit before they are killed (the API server gets it on top
# of its drain, --shutdown-timeout).
STOP_GRACE_S = 10.0
CHILD_FAILED_EXIT_CODE = 1
EXIT_CODE_WAIT_S = 1.0
API_CHILD = "api"


def describe_exit(exitcode: int | None) -> str:
    """multiprocessing's exit code in words: negative means killed by that signal."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _send_signal(process: BaseProcess, sig: int) -> None:
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(process.pid, sig)


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

    def __init__(self, args: ServerArgs, replica: int | None = None) -> None:
        self.args = args
        # With --dp (minisgl.runtime.dp), children are named per replica: sched0, api1, ...
        self._name_suffix = "" if replica is None else str(replica)
        self.endpoints: Endpoints | None = None
        self._children: list[_Child] = []
        self._num_stop_requests = 0

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    @property
    def stop_requested(self) -> bool:
        return self._num_stop_requests > 0

    def request_stop(self) -> None:
        """Safe to call from a signal handler: the wait loops notice within WATCH_INTERVAL_S.
        A second call while the API server drains makes it abort what is left at once."""
        self._num_stop_requests += 1

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
                "minisgl.runtime.scheduler_proc:run_scheduler_process",
                (self.args, endpoints),
            ),
            (
                "detok",
                "minisgl.runtime.detokenizer_proc:run_detokenizer_process",
                (tokenizer_path, endpoints),
            ),
            (
                "api",
                "minisgl.server.api:run_api_server",
                (self.args, endpoints, tokenizer_path, model_path),
            ),
        ]
        for base_name, target, args in targets:
            name = base_name + self._name_suffix
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
            if self.stop_requested:
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
                        f"{child.name} exited during startup "
                        f"({describe_exit(child.process.exitcode)})"
                    ) from None
                if kind == "error":
                    raise StackError(str(payload))
                child.ready = True

    def ready_message(self) -> str:
        return f"minisgl serving {served_model_name(self.args)} at {self.url}"

    @property
    def sentinels(self) -> list[int]:
        """Become ready (multiprocessing.connection.wait) when a child exits."""
        return [child.process.sentinel for child in self._children]

    def exited_child(self) -> str | None:
        """The first child that has exited, in words, or None while all run."""
        for child in self._children:
            if not child.process.is_alive():
                # The sentinel fires as the child exits, a moment before its code can be read.
                child.process.join(timeout=EXIT_CODE_WAIT_S)
                return f"{child.name} exited unexpectedly ({describe_exit(child.process.exitcode)})"
        return None

    def watch(self) -> int:
        """Block until a stop is requested (0) or any child exits (non-zero)."""
        while not self.stop_requested:
            wait(self.sentinels, timeout=WATCH_INTERVAL_S)
            failure = self.exited_child()
            if failure is not None:
                logger.error("%s; shutting down", failure)
                return CHILD_FAILED_EXIT_CODE
        return 0

    def _stop_api_server(self, backend_failed: bool) -> None:
        """SIGTERM (drain) or BACKEND_FAILED_SIGNAL to the API server; wait for it to exit.
        While it drains, a worker dying or another stop request cuts the drain short."""
        api_name = API_CHILD + self._name_suffix
        api = next((c for c in self._children if c.name == api_name), None)
        if api is None or not api.process.is_alive():
            return
        drain_s = 0.0 if backend_failed else self.args.shutdown_timeout_s
        deadline_s = time.monotonic() + drain_s + STOP_GRACE_S
        if backend_failed:
            _send_signal(api.process, BACKEND_FAILED_SIGNAL)
        else:
            api.process.terminate()
        workers = {c.process.sentinel: c for c in self._children if c is not api}
        num_stops_seen = self._num_stop_requests
        while api.process.is_alive() and time.monotonic() < deadline_s:
            wait([api.process.sentinel, *workers], timeout=WATCH_INTERVAL_S)
            if not backend_failed and any(not c.process.is_alive() for c in workers.values()):
                backend_failed = True
                _send_signal(api.process, BACKEND_FAILED_SIGNAL)
            if self._num_stop_requests > num_stops_seen:  # asked again: stop waiting
                num_stops_seen = self._num_stop_requests
                api.process.terminate()

    def shutdown(self, backend_failed: bool = False) -> None:
        """Stop every child, front to back (see the module docstring); idempotent."""
        self._stop_api_server(backend_failed)
        for child in self._children:
            if child.process.is_alive():
                child.process.terminate()
        deadline_s = time.monotonic() + STOP_GRACE_S
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


class Stack(Protocol):
    """What `run_until_stopped` drives: a ServerStack, or the replicas of --dp (DataParallelStack
    in minisgl.runtime.dp)."""

    @property
    def stop_requested(self) -> bool: ...

    def request_stop(self) -> None: ...

    def start(self) -> None: ...

    def wait_ready(self) -> None: ...

    def ready_message(self) -> str: ...

    def watch(self) -> int: ...

    def shutdown(self, backend_failed: bool = False) -> None: ...


def serve(args: ServerArgs) -> int:
    """Run the server until SIGTERM / Ctrl-C; the return value is the process exit code."""
    setup_logging(args.log_level)
    return run_until_stopped(ServerStack(args))


def run_until_stopped(stack: Stack) -> int:
    """Start `stack`, serve until SIGTERM / Ctrl-C or a failure, always shut it down; the return
    value is the process exit code."""
    previous = {
        sig: signal.signal(sig, lambda *_: stack.request_stop())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    exit_code = CHILD_FAILED_EXIT_CODE
    try:
        stack.start()
        stack.wait_ready()
        logger.info("%s", stack.ready_message())
        exit_code = stack.watch()
    except StackError as exc:
        if stack.stop_requested:
            exit_code = 0
        else:
            logger.error("server failed to start: %s", exc)
    finally:
        stack.shutdown(backend_failed=exit_code != 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code
