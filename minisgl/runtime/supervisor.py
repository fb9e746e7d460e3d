"""Running a piece of the server in its own process (multiprocessing, "spawn").

Each child reports back to the launcher over a pipe: ("ready", info) once it serves, or
("error", message) if it fails. Children ignore Ctrl-C (the launcher orders the shutdown), exit
cleanly on SIGTERM, and exit on their own if the launcher disappears (e.g. SIGKILL), so no process
is ever left behind.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
PARENT_POLL_INTERVAL_S = 0.5
PARENT_GONE_EXIT_CODE = 3
CHILD_ERROR_EXIT_CODE = 1
PROCESS_NAME_MAX_LEN = 15
# The launcher tells the API server that a process behind it died: fail open requests now.
BACKEND_FAILED_SIGNAL = signal.SIGUSR1


def set_process_name(name: str) -> None:
    """Show `name` in ps/top (Linux: the kernel keeps 15 characters); elsewhere a no-op."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:PROCESS_NAME_MAX_LEN])


class ChildStartupError(RuntimeError):
    """A child cannot start for a reason the message explains (logged without a traceback)."""


def setup_logging(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(0)  # SystemExit unwinds the child's loop, running its cleanup


def _watch_parent(parent_pid: int, orphan_cleanup_dir: str | None) -> None:
    while True:
        time.sleep(PARENT_POLL_INTERVAL_S)
        if os.getppid() != parent_pid:
            # Orphaned (the launcher was killed): it cannot clean up, so whoever notices first does.
            if orphan_cleanup_dir:
                shutil.rmtree(orphan_cleanup_dir, ignore_errors=True)
            os._exit(PARENT_GONE_EXIT_CODE)


def _resolve(target: str) -> Callable[..., None]:
    module_name, _, function_name = target.partition(":")
    return cast(Callable[..., None], getattr(importlib.import_module(module_name), function_name))


def child_main(
    name: str,
    target: str,
    conn: Connection,
    log_level: str,
    orphan_cleanup_dir: str | None,
    *args: Any,
) -> None:
    """Entry point of every child. `target` ("module:function") runs as
    `function(*args, report_ready)` and returns when the child should exit.
    `orphan_cleanup_dir` is removed if the launcher dies without cleaning up."""
    set_process_name(f"minisgl:{name}")
    setup_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(BACKEND_FAILED_SIGNAL, _exit_on_sigterm)  # the API server handles it itself
    watchdog = threading.Thread(
        target=_watch_parent, args=(os.getppid(), orphan_cleanup_dir), daemon=True
    )
    watchdog.start()

    def report_ready(info: dict[str, Any] | None = None) -> None:
        conn.send(("ready", info or {}))

    exit_code = 0
    try:
        _resolve(target)(*args, report_ready)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 0
    except ChildStartupError as exc:  # expected (port taken, ...): the message says it all
        logging.getLogger(name).error("%s: %s", name, exc)
        exit_code = _report_error(conn, f"{name}: {exc}")
    except BaseException as exc:
        logging.getLogger(name).error("%s failed:\n%s", name, traceback.format_exc())
        exit_code = _report_error(conn, f"{name}: {type(exc).__name__}: {exc}")
    # Cleanup already ran in the target's finally blocks. Skip interpreter teardown: with torch
    # loaded it takes over a second, which would only delay shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _report_error(conn: Connection, message: str) -> int:
    with contextlib.suppress(OSError):  # the launcher may already be gone
        conn.send(("error", message))
    return CHILD_ERROR_EXIT_CODE
