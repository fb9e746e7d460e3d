"""Tensor parallelism, the follower side: the command protocol and the ranks 1..N-1 that obey it.

Rank 0 (`minisgl.scheduler.tp`) broadcasts one `Command` per step over the gloo control group;
a follower (`start_rank`, then `follow`) replays each on its own `Scheduler`. `Followers` spawns
a node's follower processes and watches them: each reports over a pipe that it started, then
that it is ready or why it failed, so rank 0 can name the rank that broke the group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import torch
import torch.distributed as dist

from minisgl.config import ServerArgs
from minisgl.core import Req
from minisgl.distributed import (
    control_group,
    destroy_distributed,
    init_distributed,
    ranks_per_node,
)
from minisgl.engine.engine import resolve_device
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# After "stop", followers drain one in-flight batch and leave the group: seconds at most.
JOIN_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0
PARENT_POLL_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1
# Spawned children re-import the caller's main module: the classic way that fails.
_BOOTSTRAP_HINT = (
    " before it started (its stderr says why; in a script, run LLM(..., tp_size=N) under "
    "`if __name__ == '__main__':`: tp ranks are spawned processes that import the main module)"
)


class TPRankError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the tp group is no longer usable."""


# ---- what rank 0 broadcasts ----------------------------------------------------------------------


@dataclass(frozen=True)
class AddOp:
    req: Req  # pickled before rank 0 applies it, so every rank gets the same fresh request


@dataclass(frozen=True)
class AbortOp:
    rid: str


Op = AddOp | AbortOp


@dataclass(frozen=True)
class Command:
    """One broadcast: apply `ops` in order, then run `kind` ("stop" ends the follower loop)."""

    kind: Literal["step", "flush", "stop"]
    ops: tuple[Op, ...] = ()


def broadcast(obj: Any) -> None:
    """Rank 0's side of the control group: every other rank gets `obj` from `_receive`."""
    dist.broadcast_object_list([obj], src=0, group=control_group())


def _receive() -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def apply_ops(scheduler: Scheduler, ops: Sequence[Op]) -> None:
    for op in ops:
        if isinstance(op, AddOp):
            scheduler.add_request(op.req)
        else:
            scheduler.abort_request(op.rid)


def dist_backend(args: ServerArgs) -> str:
    return "nccl" if resolve_device(args.device).type == "cuda" else "gloo"


def cpu_threads_per_rank(args: ServerArgs) -> int | None:
    """On CPU the ranks of a node share its cores: oversubscribing them slows every rank."""
    if resolve_device(args.device).type != "cpu":
        return None
    # The cores this process may use: --dp pins each replica to its own (minisgl.runtime.dp).
    if hasattr(os, "sched_getaffinity"):
        num_cpus = len(os.sched_getaffinity(0))
    else:
        num_cpus = os.cpu_count() or 1
    return max(1, num_cpus // ranks_per_node(args.tp_size, args.nnodes))


def _adopt(own: ServerArgs, primary: ServerArgs) -> ServerArgs:
    """Rank 0's args, so every rank schedules alike; a node keeps its own --model path and
    --download-dir if given (both are paths on that node)."""
    model = own.model if own.model is not None else primary.model
    download_dir = own.download_dir or primary.download_dir
    return primary.replace(model=model, download_dir=download_dir, node_rank=own.node_rank)


# ---- ranks 1..N-1 ------------------------------------------------------------------------------


def start_rank(args: ServerArgs, rank: int) -> Scheduler:
    """Join the tp group as `rank` (> 0), take rank 0's args, build this rank's scheduler."""
    assert args.dist_init_addr is not None
    local_rank = rank % ranks_per_node(args.tp_size, args.nnodes)
    init_distributed(rank, args.tp_size, args.dist_init_addr, dist_backend(args), local_rank)
    args = _adopt(args, _receive())
    threads = cpu_threads_per_rank(args)
    if threads is not None:
        torch.set_num_threads(threads)
    return Scheduler(args)


def follow(scheduler: Scheduler) -> None:
    """Replay rank 0's commands until it says stop (or a collective fails: rank 0 is gone)."""
    while True:
        command: Command = _receive()
        apply_ops(scheduler, command.ops)
        if command.kind == "stop":
            return
        if command.kind == "step":
            scheduler.step()  # outputs are rank 0's business
        elif command.kind == "flush":
            scheduler.flush_cache()


def close_quietly(scheduler: Scheduler | None) -> None:
    try:
        if scheduler is not None:
            scheduler.shutdown()
    except Exception as exc:  # a peer is gone: nothing left to drain with
        logger.debug("tp follower: shutdown: %s", exc)
    destroy_distributed()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    os._exit(1)  # orphaned: never linger as a stray process


def _follower_main(args: ServerArgs, rank: int, conn: Connection) -> None:
    """Entry point of a spawned follower; reports "started", then "ready" or "error"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn.send(("started", ""))
    scheduler: Scheduler | None = None
    try:
        scheduler = start_rank(args, rank)
        conn.send(("ready", ""))
        follow(scheduler)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # rank 0 may be gone already
            conn.send(("error", f"tp rank {rank}: {traceback.format_exc()}"))
        logger.error("tp rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        close_quietly(scheduler)
        raise SystemExit(1) from None
    close_quietly(scheduler)


# ---- the spawned processes, seen from the rank that started them --------------------------------


@dataclass
class _Follower:
    rank: int
    process: BaseProcess
    conn: Connection  # the parent's end: ("started", ""), ("ready", ""), or ("error", traceback)
    started: bool = False
    ready: bool = False
    error: str | None = None
    conn_closed: bool = False


class Followers:
    """The spawned ranks of node 0 (or of node k in `run_follower_node`)."""

    def __init__(self, args: ServerArgs, ranks: Sequence[int]) -> None:
        ctx = mp.get_context("spawn")  # torch state does not survive fork safely
        self.members: list[_Follower] = []
        for rank in ranks:
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_follower_main,
                args=(args, rank, child_conn),
                name=f"minisgl-tp{rank}",
                daemon=True,  # also terminated if the caller exits without shutdown()
            )
            process.start()
            child_conn.close()  # EOF on parent_conn now means the child is gone
            self.members.append(_Follower(rank, process, parent_conn))

    @property
    def pids(self) -> list[int]:
        return [f.process.pid for f in self.members if f.process.pid is not None]

    def _read_reports(self, timeout_s: float = 0.0) -> None:
        open_conns = {f.conn: f for f in self.members if not f.conn_closed}
        if not open_conns:
            return
        for conn in wait(list(open_conns), timeout=timeout_s):
            follower = open_conns[conn]  # type: ignore[index]
            try:
                kind, payload = follower.conn.recv()
            except (EOFError, OSError):  # the child is gone; dead() tells how it ended
                follower.conn_closed = True
                follower.conn.close()
                continue
            if kind == "started":
                follower.started = True
            elif kind == "ready":
                follower.ready = True
            else:
                follower.error = payload

    def wait_started(self, timeout_s: float) -> None:
        """Wait until every child runs our code: one that dies while Python bootstraps it
        would otherwise leave rank 0 waiting for the whole rendezvous timeout."""
        self._wait_for(lambda f: f.started, timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        self._wait_for(lambda f: f.ready, timeout_s)

    def _wait_for(self, done: Callable[[_Follower], bool], timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        while not all(done(f) for f in self.members):
            self._read_reports(timeout_s=POLL_INTERVAL_S)
            failure = self.failure()
            if failure is not None:
                raise TPRankError(f"tensor parallelism failed to start: {failure}")
            if time.monotonic() > deadline_s:
                raise TPRankError(f"tp ranks did not start within {timeout_s:.0f} s")

    def dead(self) -> list[_Follower]:
        """Followers that exited (at any time before shutdown, any exit is a failure)."""
        return [f for f in self.members if not f.process.is_alive()]

    def failure(self, grace_s: float = 0.0) -> str | None:
        """Why the group broke, if a follower reported an error or exited; None if all look fine."""
        if grace_s > 0:
            # A killed child's sockets (and sentinel) close a moment before it can be reaped.
            exited = wait([f.process.sentinel for f in self.members], timeout=grace_s)
            for f in self.members:
                if f.process.sentinel in exited:
                    f.process.join(timeout=grace_s)
        self._read_reports()
        for f in self.members:
            if f.error is not None:
                return f.error
        for f in self.dead():
            hint = "" if f.started else _BOOTSTRAP_HINT
            return (
                f"tp rank {f.rank} (pid {f.process.pid}) exited with code "
                f"{f.process.exitcode}{hint}"
            )
        return None

    def stop(self) -> None:
        """Join the followers (they were told to stop); terminate, then kill, the stragglers."""
        deadline_s = time.monotonic() + JOIN_TIMEOUT_S
        for f in self.members:
            f.process.join(timeout=max(0.0, deadline_s - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for f in self.members:
            if f.process.is_alive():
                f.process.terminate()
                f.process.join(timeout=KILL_TIMEOUT_S)
            if f.process.is_alive():
                f.process.kill()
                f.process.join(timeout=KILL_TIMEOUT_S)
            if not f.conn_closed:
                f.conn_closed = True
                f.conn.close()
