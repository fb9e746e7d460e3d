"""The API server's grammar compiles, out of its process: a constraint that would take the
server's memory or time costs its own request a 400, never the server (xgrammar's C++ cannot be
interrupted, and some small inputs blow up: RESULTS.md section 17). A constraint over
MAX_CONSTRAINT_BYTES is refused; a compile past --grammar-compile-timeout or
MAX_WORKER_RSS_BYTES is killed (a 400 naming the field). One process builds the compiler once
and forks a child per compile, so a kill costs nobody else anything. Answers (a grammar, or
xgrammar's refusal) are cached by `grammar_key`; a kill is not (a timeout depends on the load)."""

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil
from transformers import PreTrainedTokenizerBase

from minisgl.core import Constraint
from minisgl.grammar.compiler import GrammarCache, GrammarCompiler
from minisgl.limits import (
    GIB,
    KIB,
    MAX_COMPILES_PER_CLIENT,
    MAX_CONSTRAINT_BYTES,
    MAX_WORKER_RSS_BYTES,
    InvalidRequestError,
)
from minisgl.runtime.supervisor import prepare_exec_child

RSS_POLL_INTERVAL_S = 0.05
WORKER_NAME = "minisgl:grammar"  # its name in ps (its compiles' too)
# The model's processes come first where they share cores with a compile (CPU serving), which
# shortens the gaps a compile causes in other requests' streams (RESULTS.md section 17).
WORKER_NICENESS = 10
# Compiles at once: one per core; one tenant's leave a core to the others.
MAX_RUNNING = len(os.sched_getaffinity(0))
MAX_RUNNING_PER_CLIENT = max(1, MAX_RUNNING - 1)

Outcome = tuple[bool, str]  # (compiled, the grammar's JSON text or why it was refused)


def _serve(
    conn: Connection, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: Sequence[int]
) -> None:
    """The compiler process: for each (job id, constraint) that arrives, a forked child
    compiles it. Sends (job id, the child's pid) at the fork and (job id, the child's outcome,
    or why it stopped) at its end, until the pipe closes."""
    prepare_exec_child()  # Ctrl-C is the server's to handle; SIGTERM when the server dies
    with contextlib.suppress(OSError):  # our name in ps/top
        Path("/proc/self/comm").write_text(WORKER_NAME)
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    conn.send("ready")
    children: dict[Connection, int] = {}  # a child's pipe -> its job id
    while True:
        ready = wait([conn, *children])
        for pipe in [pipe for pipe in children if pipe in ready]:  # an outcome, or an end
            outcome: Outcome | None = None
            with contextlib.suppress(EOFError):
                outcome = pipe.recv()
            pipe.close()
            conn.send((children.pop(pipe), outcome or "the grammar compiler stopped"))
        if conn in ready:
            try:
                job_id, constraint = conn.recv()
            except EOFError:  # the API server closed it (or is gone)
                return
            reader, writer = mp.Pipe(duplex=False)
            if (pid := os.fork()) == 0:
                try:  # never back into this loop
                    prepare_exec_child()  # SIGTERM when this process dies
                    writer.send((True, compiler.compile(constraint).serialize_json()))
                except InvalidRequestError as exc:
                    writer.send((False, exc.message))
                finally:
                    os._exit(0)
            writer.close()
            children[reader] = job_id
            conn.send((job_id, pid))


@dataclass(eq=False)
class _Job:
    """One request's constraint to compile, for its client (tenant)."""

    constraint: Constraint
    client: str | None
    done: asyncio.Future[Outcome]
    id: int
    pid: int | None = None  # the child compiling it, once forked


class GrammarWorker:
    """The API server's side, on its event loop: constraints compiled in the compiler process,
    MAX_RUNNING at once, MAX_RUNNING_PER_CLIENT of one client (tenant); a free turn goes to the
    queued job of the client with the fewest running, the first to arrive among them; at most
    MAX_COMPILES_PER_CLIENT of a client queued or running. Cached. The process starts at the
    first uncached constraint."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float,
    ) -> None:
        self._worker_args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self.timeout_s = timeout_s
        # Starts the process, then sends to it: a send may wait until it reads, while it may be
        # sending to us. The process's SIGTERM on our death (PR_SET_PDEATHSIG) is tied to this
        # thread, which lives as long as the process; so is its niceness (Linux: per thread),
        # which the process has from its first instruction on.
        self._thread = ThreadPoolExecutor(1, "minisgl-grammar", os.nice, (WORKER_NICENESS,))
        self._cache = GrammarCache(lambda outcome: len(outcome[1]))
        self._conn: Connection | None = None
        self._ready: asyncio.Future[None] | None = None  # the process's start
        self._queue: list[_Job] = []
        self._running: dict[int, _Job] = {}  # by id
        self._ids = itertools.count()

    async def serialize(
        self,
        constraint: Constraint,
        param: str,
        client: str | None,
        gone: Callable[[], Awaitable[Any]],
    ) -> str:
        """The constraint compiled and serialized for the scheduler. Raises InvalidRequestError
        naming `param` when it is too big, bad, too slow or too large to compile, when `client`
        has MAX_COMPILES_PER_CLIENT pending, or when `gone` (the client left) returns first."""
        size = len(constraint.value.encode())
        if size > MAX_CONSTRAINT_BYTES:
            limit = f"{MAX_CONSTRAINT_BYTES} bytes ({MAX_CONSTRAINT_BYTES // KIB} KiB)"
            raise InvalidRequestError(param, f"the grammar is {size} bytes; at most {limit}")
        if (outcome := self._cache.get(constraint.grammar_key)) is None:
            await self._start()
            pending = [*self._queue, *self._running.values()]
            if sum(job.client == client for job in pending) >= MAX_COMPILES_PER_CLIENT:
                raise InvalidRequestError(
                    param,
                    f"{MAX_COMPILES_PER_CLIENT} grammars of this client are compiling or queued; "
                    "retry when one is done",
                    HTTPStatus.TOO_MANY_REQUESTS,
                )
            done = asyncio.get_running_loop().create_future()
            job = _Job(constraint, client, done, next(self._ids))
            outcome = await self._wait(job, asyncio.ensure_future(gone()))
        compiled, text = outcome
        if not compiled:
            raise InvalidRequestError(param, text)
        return text

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._ready is None:
            self._ready = loop.create_future()
            ctx = mp.get_context("spawn")
            self._conn, child_conn = ctx.Pipe()
            args = (child_conn, *self._worker_args)  # daemon: stopped if we exit normally
            process = ctx.Process(target=_serve, args=args, name=WORKER_NAME, daemon=True)
            loop.add_reader(self._conn.fileno(), self._receive)
            await loop.run_in_executor(self._thread, process.start)
            child_conn.close()  # the process holds its own copy: EOF here means it is gone
        await asyncio.shield(self._ready)  # or its error: the process ended first

    def _dispatch(self) -> None:
        """Give the free turns to queued jobs."""
        while len(self._running) < MAX_RUNNING:
            running = Counter(job.client for job in self._running.values())
            allowed = [job for job in self._queue if running[job.client] < MAX_RUNNING_PER_CLIENT]
            if not allowed:
                return
            job = min(allowed, key=lambda job: running[job.client])
            self._queue.remove(job)
            self._running[job.id] = job
            assert self._conn is not None
            self._thread.submit(self._conn.send, (job.id, job.constraint))

    async def _wait(self, job: _Job, left: asyncio.Future[Any]) -> Outcome:
        """The job queued and compiled; a refusal when it runs out of time (counted from now) or
        memory, or when `left` is done (the client left). Dropped when this ends however it ends
        (cancelled too), queued or running."""
        self._queue.append(job)
        self._dispatch()
        deadline_s = time.monotonic() + self.timeout_s
        try:
            while not job.done.done():
                if left.done():  # nobody reads the answer
                    return False, "the client left"
                if time.monotonic() > deadline_s:
                    limit = f"{self.timeout_s:g} s (--grammar-compile-timeout)"
                    return False, f"compiling the grammar took longer than {limit}"
                with contextlib.suppress(psutil.Error):
                    if job.pid and psutil.Process(job.pid).memory_info().rss > MAX_WORKER_RSS_BYTES:
                        gib = MAX_WORKER_RSS_BYTES / GIB
                        return False, f"the grammar needs more than {gib:g} GiB to compile"
                await asyncio.wait(
                    [job.done, left],
                    timeout=RSS_POLL_INTERVAL_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            return job.done.result()
        finally:
            left.cancel()
            if job in self._queue:
                self._queue.remove(job)
            if self._running.pop(job.id, None) is not None and job.pid:
                _kill(job.pid)
            self._dispatch()

    def _receive(self) -> None:
        """A message from the compiler process (on the event loop: it is ready to read)."""
        assert self._conn is not None and self._ready is not None
        try:
            message = self._conn.recv()
        except (EOFError, OSError):  # it is gone: so are its compiles
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            stopped = "the grammar compiler stopped"
            if not self._ready.done():
                self._ready.set_exception(RuntimeError(stopped))
            self._ready = None
            for pending in [*self._queue, *self._running.values()]:
                if not pending.done.done():
                    pending.done.set_result((False, stopped))
            return
        if message == "ready":
            self._ready.set_result(None)
            return
        job_id, reply = message
        job = self._running.get(job_id)
        if isinstance(reply, int):  # its child's pid
            if job is None:  # it ended meanwhile
                _kill(reply)
            else:
                job.pid = reply
        elif job is not None:  # its outcome, or why its child stopped (not cached)
            job.pid = None  # it has ended
            if isinstance(reply, str):
                reply = False, reply
            else:
                self._cache.put(job.constraint.grammar_key, reply)
            job.done.set_result(reply)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
