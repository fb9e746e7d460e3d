"""One supervisor for every child process minisgl starts (the server's processes, tp ranks
1..N-1, the gateway). A Python child is "spawn"ed into `child_main` and reports "started",
"ready" or "error" over a pipe; it ignores Ctrl-C, exits on SIGTERM, and exits on its own if
the parent disappears, so no process is left behind. `Children` reads the reports, says why a
child is gone, and stops them all. Standard library only: the launcher, the tp ranks and the
offline `LLM` use it without pulling anything heavy in."""

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pkgutil
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

logger = logging.getLogger("minisgl")

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
PARENT_POLL_INTERVAL_S = 0.5
PARENT_GONE_EXIT_CODE = 3
CHILD_ERROR_EXIT_CODE = 1
PROCESS_NAME_MAX_LEN = 15
# How often waiting parents look at their children's pipes and sentinels.
WATCH_INTERVAL_S = 0.2
# The sentinel fires as a child exits, a moment before its exit code can be read.
EXIT_CODE_WAIT_S = 1.0
# The launcher tells the API server that a process behind it died: fail open requests now.
BACKEND_FAILED_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1  # prctl(2)


class ChildStartupError(RuntimeError):
    """Raised in a child that cannot start, for a reason its message explains (port taken, ...):
    logged and reported without a traceback."""


class StartupError(RuntimeError):
    """Raised in the parent: its processes did not start (or were stopped while starting); the
    message says which one and why."""


def setup_logging(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


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


# ---- in the child ------------------------------------------------------------------------------


def _exit_on_signal(signum: int, frame: Any) -> None:
    sys.exit(0)  # SystemExit unwinds the child's loop, running its cleanup


def _watch_parent(parent_pid: int, orphan_cleanup_dir: str | None) -> None:
    while True:
        time.sleep(PARENT_POLL_INTERVAL_S)
        if os.getppid() != parent_pid:
            # Orphaned (the parent was killed): it cannot clean up, so whoever notices first does.
            if orphan_cleanup_dir:
                shutil.rmtree(orphan_cleanup_dir, ignore_errors=True)
            os._exit(PARENT_GONE_EXIT_CODE)


def _report(conn: Connection, kind: str, payload: str = "") -> None:
    with contextlib.suppress(OSError):  # the parent may already be gone
        conn.send((kind, payload))


def child_main(
    name: str,
    target: str,
    conn: Connection,
    log_level: str | None,
    cleanup_dir: str | None,
    *args: Any,
) -> None:
    """Entry point of every Python child. `target` ("module:function") runs as
    `function(*args, report_ready)` and returns when the child should exit. With `log_level`
    the child logs in the server's format; `cleanup_dir` is removed if the parent dies first."""
    with contextlib.suppress(OSError):  # our name in ps/top (Linux keeps 15 characters)
        Path("/proc/self/comm").write_text(f"minisgl:{name}"[:PROCESS_NAME_MAX_LEN])
    if log_level is not None:
        setup_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(BACKEND_FAILED_SIGNAL, _exit_on_signal)  # the API server handles it itself
    threading.Thread(target=_watch_parent, args=(os.getppid(), cleanup_dir), daemon=True).start()
    _report(conn, "started")
    exit_code = 0
    try:
        pkgutil.resolve_name(target)(*args, lambda: _report(conn, "ready"))
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 0
    except ChildStartupError as exc:  # expected (port taken, ...): the message says it all
        logging.getLogger(name).error("%s: %s", name, exc)
        _report(conn, "error", str(exc))
        exit_code = CHILD_ERROR_EXIT_CODE
    except BaseException as exc:
        logging.getLogger(name).error("%s failed:\n%s", name, traceback.format_exc())
        _report(conn, "error", f"{type(exc).__name__}: {exc}")
        exit_code = CHILD_ERROR_EXIT_CODE
    # Cleanup already ran in the target's finally blocks. Skip interpreter teardown: with torch
    # loaded it takes over a second, which would only delay shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def prepare_exec_child() -> None:
    """`preexec_fn` of a child that is not Python (the gateway), run just before it execs.
    SIGINT ignored: Python then installs no KeyboardInterrupt handler (which would print a
    traceback after the program's own Ctrl-C handling, installed later, has run). SIGTERM when
    the parent dies (Linux): it cannot run our watchdog."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# ---- in the parent -----------------------------------------------------------------------------


@dataclass
class Child:
    name: str  # in messages: "sched", "api1", "tp rank 1"
    process: BaseProcess
    conn: Connection  # the parent's end of the report pipe
    started: bool = False  # our code runs in it (it got past Python's bootstrap)
    ready: bool = False
    error: str | None = None  # what it reported when it failed


@dataclass
class Children:
    """Child processes started together, watched together and stopped together."""

    log_level: str | None = None  # they log in the server's format at this level; None: untouched
    cleanup_dir: str | None = None  # removed by whichever child outlives this process
    # multiprocessing terminates daemons when this process exits without stopping them (a
    # daemon may not start children of its own)
    daemon: bool = False
    not_started_hint: str = ""  # in the failure of a child that died before running our code
    members: list[Child] = field(default_factory=list)

    def spawn(self, name: str, target: str, *args: Any, title: str | None = None) -> None:
        """Start `target` (see `child_main`) in a new process; `title`: its name in ps and in
        log lines, if not `name`."""
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        title = title or name
        process = ctx.Process(
            target=child_main,
            args=(title, target, child_conn, self.log_level, self.cleanup_dir, *args),
            name=f"minisgl-{title}",
            daemon=self.daemon,
        )
        process.start()
        child_conn.close()  # the child holds its own copy; EOF here means the child is gone
        self.members.append(Child(name, process, parent_conn))

    @property
    def sentinels(self) -> list[int]:
        """Become ready (multiprocessing.connection.wait) when a child exits."""
        return [c.process.sentinel for c in self.members]

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the first failed child failed, in words (its report, or how it exited); None
        while every child runs. `wait_s`: first wait up to that long for news (a report, an
        exit) from any child."""
        open_conns = [c.conn for c in self.members if not c.conn.closed]
        news = wait([*open_conns, *self.sentinels], timeout=wait_s)
        for child in self.members:
            if child.process.sentinel in news:  # exiting: it can be reaped a moment later
                child.process.join(timeout=EXIT_CODE_WAIT_S)
            while not child.conn.closed and child.conn.poll():
                try:
                    kind, payload = child.conn.recv()
                except (EOFError, OSError):  # gone; its exit code tells how it ended
                    child.conn.close()
                    break
                child.started = True  # whatever it says, our code runs in it
                if kind == "ready":
                    child.ready = True
                elif kind == "error":
                    child.error = payload
            if child.error is not None:
                return f"{child.name}: {child.error}"
            if not child.process.is_alive():  # reaped: its exit code is known
                when = "unexpectedly" if child.ready else "during startup"
                hint = "" if child.started else self.not_started_hint
                return f"{child.name} exited {when} ({describe_exit(child.process.exitcode)}){hint}"
        return None

    def wait(
        self,
        done: Callable[[Child], bool],
        timeout_s: float,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        """Until `done(child)` holds for every child; StartupError when one fails first, time
        runs out or a stop is requested."""
        deadline_s = time.monotonic() + timeout_s
        while not all(done(c) for c in self.members):
            if stop_requested():
                raise StartupError("stopped during startup")
            if (failure := self.failure(wait_s=WATCH_INTERVAL_S)) is not None:
                raise StartupError(failure)
            if time.monotonic() > deadline_s:
                late = ", ".join(c.name for c in self.members if not done(c))
                raise StartupError(f"{late} did not start within {timeout_s:.0f} s")

    def stop(self, grace_s: float, exit_first_s: float = 0.0) -> None:
        """Stop every child: give them `exit_first_s` to exit on their own (they were told to),
        then SIGTERM, `grace_s` more, and SIGKILL for what is left. Idempotent."""
        self._join_all(exit_first_s)
        for child in self.members:
            if child.process.is_alive():
                child.process.terminate()
        self._join_all(grace_s)
        for child in self.members:
            if child.process.is_alive():
                logger.warning("%s did not stop in time; killing it", child.name)
                child.process.kill()
                child.process.join()
            child.conn.close()

    def _join_all(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        for child in self.members:
            child.process.join(timeout=max(0.0, deadline_s - time.monotonic()))
