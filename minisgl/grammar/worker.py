"""The API server's grammar compiles, in a worker process: a constraint that would take the
server's memory or time costs its own request a 400, never the server (xgrammar's C++ cannot be
interrupted, and some small inputs blow up: RESULTS.md section 17). A constraint over
MAX_CONSTRAINT_BYTES is refused; a worker past --grammar-compile-timeout or MAX_WORKER_RSS_BYTES
is killed (a 400 naming the field; the next constraint starts a fresh one). Answers (a grammar, or
xgrammar's refusal) are cached by `grammar_key`; a kill is not (a timeout depends on the load)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import psutil
from transformers import PreTrainedTokenizerBase

from minisgl.core import Constraint
from minisgl.grammar.compiler import GrammarCache, GrammarCompiler
from minisgl.limits import (
    GIB,
    KIB,
    MAX_CONSTRAINT_BYTES,
    MAX_WORKER_RSS_BYTES,
    InvalidRequestError,
)
from minisgl.runtime.supervisor import describe_exit, prepare_exec_child

RSS_POLL_INTERVAL_S = 0.05
# Spawning it: importing torch, xgrammar and the tokenizer, then reading the vocabulary.
STARTUP_TIMEOUT_S = 120.0
WORKER_NAME = "minisgl:grammar"  # its name in ps
# The model's processes come first where they share cores with a compile (CPU serving), which
# shortens the gaps a compile causes in other requests' streams (RESULTS.md section 17).
WORKER_NICENESS = 10

Outcome = tuple[bool, str]  # (compiled, the grammar's JSON text or why it was refused)


class _Stopped(Exception):
    """The worker was killed (too slow, too big) or died: the message says which."""


def _serve(
    conn: Connection, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: Sequence[int]
) -> None:
    """The worker process: compile each constraint that arrives until the pipe closes."""
    prepare_exec_child()  # Ctrl-C is the server's to handle; SIGTERM when the server dies
    os.nice(WORKER_NICENESS)
    with contextlib.suppress(OSError):  # our name in ps/top
        Path("/proc/self/comm").write_text(WORKER_NAME)
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    conn.send((True, "ready"))
    while True:
        try:
            constraint = conn.recv()
        except EOFError:  # the API server closed it (or is gone)
            return
        try:
            reply = (True, compiler.compile(constraint).serialize_json())
        except InvalidRequestError as exc:
            reply = (False, exc.message)
        conn.send(reply)


class GrammarWorker:
    """The API server's side: constraints compiled in the worker, one at a time, waited for on
    a thread of its own (the event loop keeps serving), cached. Made with what the worker needs
    to build its `GrammarCompiler`; the worker starts at the first uncached constraint."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float,
    ) -> None:
        self._worker_args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self.timeout_s = timeout_s
        # One thread: compiles run one at a time. It also starts the worker, whose SIGTERM on
        # our death (PR_SET_PDEATHSIG) is tied to this thread: it lives as long as the process.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="minisgl-grammar")
        # Read on the event loop, filled on the thread.
        self._cache: GrammarCache[Outcome] = GrammarCache(lambda outcome: len(outcome[1]))
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    async def serialize(self, constraint: Constraint, param: str) -> str:
        """The constraint compiled and serialized for the scheduler. Raises InvalidRequestError
        naming `param` when it is too big, bad, too slow or too large to compile."""
        size = len(constraint.value.encode())
        if size > MAX_CONSTRAINT_BYTES:
            limit = f"{MAX_CONSTRAINT_BYTES} bytes ({MAX_CONSTRAINT_BYTES // KIB} KiB)"
            raise InvalidRequestError(param, f"the grammar is {size} bytes; at most {limit}")
        if (outcome := self._cache.get(constraint.grammar_key)) is None:
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(self._thread, self._compile, constraint)
        compiled, text = outcome
        if not compiled:
            raise InvalidRequestError(param, text)
        return text

    def _compile(self, constraint: Constraint) -> Outcome:
        """On the grammar thread."""
        key = constraint.grammar_key
        if (outcome := self._cache.get(key)) is not None:  # compiled while this one queued
            return outcome
        self._start()
        timeout_s = self.timeout_s
        late = f"compiling the grammar took longer than {timeout_s:g} s (--grammar-compile-timeout)"
        try:
            outcome = self._exchange(constraint, timeout_s, late)
        except _Stopped as exc:
            return False, str(exc)
        self._cache.put(key, outcome)
        return outcome

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self._stop()
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        args = (child_conn, *self._worker_args)  # daemon: stopped if we exit normally
        self._process = ctx.Process(target=_serve, args=args, name=WORKER_NAME, daemon=True)
        self._process.start()
        child_conn.close()  # the worker holds its own copy: EOF here means it is gone
        try:
            self._exchange(None, STARTUP_TIMEOUT_S, f"not ready after {STARTUP_TIMEOUT_S:g} s")
        except _Stopped as exc:
            raise RuntimeError(f"the grammar compiler process did not start: {exc}") from None

    def _exchange(self, request: Constraint | None, timeout_s: float, late: str) -> Outcome:
        """Send `request` (if any) and wait for the worker's answer; raises _Stopped, the
        worker killed for its time (`late`: why) or its memory, or found dead."""
        assert self._process is not None and self._conn is not None
        conn, deadline_s = self._conn, time.monotonic() + timeout_s
        try:
            if request is not None:
                conn.send(request)
            watched = psutil.Process(self._process.pid)
            while not conn.poll(RSS_POLL_INTERVAL_S):
                if watched.memory_info().rss > MAX_WORKER_RSS_BYTES:
                    self._stop()
                    gib = MAX_WORKER_RSS_BYTES / GIB
                    raise _Stopped(f"the grammar needs more than {gib:g} GiB to compile")
                if time.monotonic() > deadline_s:
                    self._stop()
                    raise _Stopped(late)
            return conn.recv()  # an Outcome
        except (EOFError, OSError, psutil.Error):
            exit_code = self._stop()
            raise _Stopped(f"the grammar compiler stopped ({describe_exit(exit_code)})") from None

    def _stop(self) -> int | None:
        """Kill the worker (if any) and forget it; its exit code."""
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        process.kill()
        process.join()
        return process.exitcode
