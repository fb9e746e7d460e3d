"""Tensor parallelism, the follower side: the command protocol and the ranks 1..N-1 that obey it.

Rank 0 (`minisgl.scheduler.tp`) broadcasts one `Command` per step over the gloo control group;
a follower (`start_rank`, then `follow`) replays each on its own `Scheduler`. `spawn_followers`
starts a node's follower processes as children of minisgl.runtime.supervisor: each reports over
a pipe that it started, then that it is ready or why it failed, so rank 0 can name the rank that
broke the group. `run_follower_node` is a whole node k > 0 (`python -m minisgl.scheduler.tp`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from minisgl.config import ServerArgs
from minisgl.core import Req
from minisgl.distributed import (
    control_group,
    destroy_distributed,
    global_tp_rank,
    init_distributed,
    ranks_per_node,
)
from minisgl.engine.engine import resolve_device
from minisgl.runtime.supervisor import Children, describe_exit
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# After "stop", followers drain one in-flight batch and leave the group: seconds at most.
JOIN_TIMEOUT_S = 10.0
# A follower that ignores SIGTERM this long is killed.
KILL_TIMEOUT_S = 5.0
# Spawned children re-import the caller's main module: the classic way that fails.
_BOOTSTRAP_HINT = (
    ", before running any minisgl code (its stderr says why; in a script, run "
    "LLM(..., tp_size=N) under `if __name__ == '__main__':`: tp ranks are spawned processes "
    "that import the main module)"
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
    """`Scheduler`'s own add and abort: rank 0 (a TPScheduler) overrides them to queue ops."""
    for op in ops:
        if isinstance(op, AddOp):
            Scheduler.add_request(scheduler, op.req)
        else:
            Scheduler.abort_request(scheduler, op.rid)


def dist_backend(args: ServerArgs) -> str:
    return "nccl" if resolve_device(args.device).type == "cuda" else "gloo"


def cpu_threads_per_rank(args: ServerArgs) -> int:
    """On CPU the ranks of a node share its cores: oversubscribing them slows every rank. Off
    CPU, the thread count as it is."""
    if resolve_device(args.device).type != "cpu":
        return torch.get_num_threads()
    # The cores this process may use: --dp pins each replica to its own (minisgl.runtime.dp).
    num_cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, num_cpus // ranks_per_node(args.tp_size, args.nnodes))


def stop_followers(followers: Children) -> None:
    """After "stop" (or a broken group): let them exit, then SIGTERM, then SIGKILL."""
    followers.stop(KILL_TIMEOUT_S, exit_first_s=JOIN_TIMEOUT_S)


# ---- ranks 1..N-1 ------------------------------------------------------------------------------


def start_rank(args: ServerArgs, rank: int) -> Scheduler:
    """Join the tp group as `rank` (> 0), take rank 0's args, build this rank's scheduler.
    Rank 0's args, so every rank schedules alike; a node keeps its own --model path and
    --download-dir if given (both are paths on that node)."""
    assert args.dist_init_addr is not None
    local_rank = rank % ranks_per_node(args.tp_size, args.nnodes)
    init_distributed(rank, args.tp_size, args.dist_init_addr, dist_backend(args), local_rank)
    rank0: ServerArgs = _receive()
    model = args.model if args.model is not None else rank0.model
    download_dir = args.download_dir or rank0.download_dir
    args = rank0.replace(model=model, download_dir=download_dir, node_rank=args.node_rank)
    torch.set_num_threads(cpu_threads_per_rank(args))
    return Scheduler(args)


def run_rank(args: ServerArgs, rank: int, report_ready: Callable[[], None] = lambda: None) -> None:
    """One follower rank, until rank 0 says stop (or a collective fails: rank 0 is gone).
    A spawned follower's process (`minisgl.runtime.supervisor.child_main` runs it, and reports its
    failure to rank 0), or the first rank of a node k > 0."""
    scheduler: Scheduler | None = None
    try:
        scheduler = start_rank(args, rank)
        report_ready()
        while True:
            command: Command = _receive()
            apply_ops(scheduler, command.ops)
            if command.kind == "stop":
                return
            if command.kind == "step":
                scheduler.step()  # outputs are rank 0's business
            elif command.kind == "flush":
                scheduler.flush_cache()
    finally:
        try:
            if scheduler is not None:
                scheduler.shutdown()
        except Exception as exc:  # a peer is gone: nothing left to drain with
            logger.debug("tp follower: shutdown: %s", exc)
        destroy_distributed()


def spawn_followers(args: ServerArgs, ranks: Sequence[int]) -> Children:
    """This node's ranks `ranks` (all > 0), each in its own process. Daemons: they are also
    terminated if the caller exits without stopping them."""
    followers = Children(daemon=True, not_started_hint=_BOOTSTRAP_HINT)
    for rank in ranks:
        target = "minisgl.scheduler.tp_ranks:run_rank"
        followers.spawn(f"tp rank {rank}", target, args, rank, title=f"tp{rank}")
    return followers


def run_follower_node(args: ServerArgs) -> None:
    """Run node `args.node_rank`'s ranks until rank 0 (on node 0) stops the group.

    The node's first rank runs in this process, the others in spawned children. Scheduling
    options come from rank 0; this node's own --model path (if given) is kept.
    """
    if args.node_rank == 0 or args.nnodes < 2:
        raise ValueError("run_follower_node is for nodes 1..nnodes-1 (node 0 runs rank 0)")
    if args.dist_init_addr is None:
        raise ValueError("dist_init_addr: node 0's 'host:port' is required")
    local_size = ranks_per_node(args.tp_size, args.nnodes)
    ranks = [
        global_tp_rank(args.node_rank, i, args.tp_size, args.nnodes) for i in range(local_size)
    ]
    followers = spawn_followers(args, ranks[1:])
    try:
        run_rank(args, ranks[0])
    finally:
        stop_followers(followers)
    failed = [child for child in followers.members if child.process.exitcode != 0]
    if failed:
        raise TPRankError(f"{failed[0].name} exited ({describe_exit(failed[0].process.exitcode)})")
