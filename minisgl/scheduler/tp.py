"""Tensor parallelism across processes: rank 0 drives, ranks 1..N-1 follow.

Every rank runs its own `Scheduler` with the same inbox each step (rank 0 broadcasts it over the
gloo control group), so their state stays identical without being compared. A rank that dies or
hangs makes rank 0 raise `TPRankError` instead of hanging, and the group stays broken.
docs/tensor_parallel.md has the whole story (how it works, failures, multi-node)."""

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from minisgl.config import ServerArgs
from minisgl.distributed import (
    TPRankError,
    control_group,
    destroy_distributed,
    free_loopback_addr,
    init_distributed,
    ranks_per_node,
    reset_tp_info,
    set_tp_info,
)
from minisgl.engine.engine import resolve_device
from minisgl.models.llama import local_head_counts
from minisgl.models.model_config import load_model_config
from minisgl.models.resolve import resolve_model_path_for
from minisgl.runtime.supervisor import Children, StartupError, describe_exit
from minisgl.scheduler.scheduler import Inbox, Scheduler
from minisgl.server import parse_server_args

logger = logging.getLogger(__name__)

# Followers past the engine's start-up all-reduce only allocate tables: they report soon after.
READY_TIMEOUT_S = 120.0
# How long to wait for a crashed follower to be reaped, so the error can name it.
DEATH_GRACE_S = 1.0
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


def make_scheduler(args: ServerArgs) -> Scheduler:
    """The scheduler `args` ask for: with tp_size > 1, rank 0 of a new tp group."""
    if args.tp_size == 1:
        return Scheduler(args)
    group = TPGroup(args)
    try:
        group.join()
        scheduler = Scheduler(group.args, tp=group)
        group.followers.wait(lambda child: child.ready, READY_TIMEOUT_S)
    except BaseException as exc:
        group.start_failed(exc)
    logger.info(
        "tp group of %d ranks ready (rendezvous %s)", args.tp_size, group.args.dist_init_addr
    )
    return scheduler


def _abandon(followers: Children) -> None:
    """Finalizer of a TPGroup dropped without close(): no stray processes, no stale group."""
    followers.stop(KILL_TIMEOUT_S)
    destroy_distributed()


class TPGroup:
    """Rank 0's side of a tp group: this node's follower processes, the broadcast of each
    step's inbox, and failure: the first one breaks the group for good (`TPRankError`)."""

    def __init__(self, args: ServerArgs) -> None:
        if args.node_rank != 0:
            raise ValueError(
                f"node_rank {args.node_rank}: rank 0 runs on node 0; other nodes run "
                "`python -m minisgl.scheduler.tp --node-rank K ...`"
            )
        if args.nnodes > 1 and args.dist_init_addr is None:
            raise ValueError("dist_init_addr: node 0's 'host:port' is required when nnodes > 1")
        self.args = args.replace(dist_init_addr=args.dist_init_addr or free_loopback_addr())
        self._closed = False
        self._broken: str | None = None  # why the group is unusable, once it is
        self._previous_threads = torch.get_num_threads()
        # Before any process starts: a model that cannot be split fails here, with the numbers
        # (leaving the tp info set to rank 0 of tp_size; reset on failure).
        set_tp_info(0, args.tp_size)
        try:
            local_head_counts(load_model_config(resolve_model_path_for(args)))
            local_size = ranks_per_node(args.tp_size, args.nnodes)
            self.followers = spawn_followers(self.args, range(1, local_size))
        except BaseException:
            reset_tp_info()
            raise
        self._finalizer = weakref.finalize(self, _abandon, self.followers)

    def join(self) -> None:
        """Meet the other ranks at the rendezvous and give them rank 0's args."""
        # Every child runs our code first: one that dies while Python bootstraps it would
        # otherwise leave rank 0 waiting for the whole rendezvous timeout.
        self.followers.wait(lambda child: child.started, READY_TIMEOUT_S)
        assert self.args.dist_init_addr is not None
        init_distributed(0, self.args.tp_size, self.args.dist_init_addr, dist_backend(self.args), 0)
        dist.broadcast_object_list([self.args], src=0, group=control_group())
        torch.set_num_threads(cpu_threads_per_rank(self.args))

    def start_failed(self, exc: BaseException) -> NoReturn:
        failure = self.followers.failure(wait_s=DEATH_GRACE_S)
        self._finalizer()  # kill followers, leave the group
        torch.set_num_threads(self._previous_threads)
        if not isinstance(exc, TPRankError) and (failure or isinstance(exc, StartupError)):
            raise TPRankError(f"tensor parallelism failed to start: {failure or exc}") from exc
        raise exc

    def broadcast(self, inbox: Inbox) -> None:
        """Send a step's inbox to every other rank (`run_rank` steps with it)."""
        self.check_health()
        try:
            dist.broadcast_object_list([inbox], src=0, group=control_group())
        except Exception as exc:
            self.fail(exc, "rank 0 could not send to the other ranks")

    def fail(self, exc: Exception | None = None, where: str = "rank 0") -> NoReturn:
        """Break the group for good: over `exc`, blamed on a follower that died, if one did."""
        if isinstance(exc, TPRankError):
            raise exc
        failure = self.followers.failure(wait_s=DEATH_GRACE_S)
        self._broken = failure or f"{where}: {type(exc).__name__}: {exc}"
        raise TPRankError(f"tensor-parallel group broken: {self._broken}") from exc

    def check_health(self) -> None:
        """Raise TPRankError if a rank on this node has died (the idle server calls this: with no
        step to run there is no collective that would fail)."""
        if self._closed:
            raise RuntimeError("the tp group is shut down")
        if self._broken is not None:
            raise TPRankError(f"tensor-parallel group broken: {self._broken}")
        if self.followers.failure() is not None:
            self.fail()

    def stop(self) -> None:
        """Tell the followers to leave their loop (queued calls are dropped: nobody waits)."""
        if self._closed or self._broken is not None or self.followers.failure() is not None:
            return
        try:
            dist.broadcast_object_list([None], src=0, group=control_group())
        except Exception as exc:
            logger.warning("tp shutdown: could not reach the followers: %s", exc)

    def close(self) -> None:
        """Leave the group and end the follower processes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Leaving first closes our sockets: followers not told to stop (the group broke) and
        # still waiting on rank 0 see the connection close and exit, instead of being killed.
        destroy_distributed()
        stop_followers(self.followers)
        self._finalizer()
        torch.set_num_threads(self._previous_threads)


# ---- ranks 1..N-1 ------------------------------------------------------------------------------


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


def _receive() -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


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
    """One follower rank: a step with each inbox rank 0 broadcasts, until rank 0 says stop
    (None) or a collective fails (rank 0 is gone). A spawned follower's process
    (`minisgl.runtime.supervisor.child_main` runs it, and reports its failure to rank 0), or
    the first rank of a node k > 0."""
    scheduler: Scheduler | None = None
    try:
        scheduler = start_rank(args, rank)
        report_ready()
        while (inbox := _receive()) is not None:
            scheduler.step(inbox)  # outputs are rank 0's business
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
        target = "minisgl.scheduler.tp:run_rank"
        followers.spawn(f"tp rank {rank}", target, args, rank, title=f"tp{rank}")
    return followers


def run_follower_node(args: ServerArgs) -> None:
    """Run node `args.node_rank`'s ranks until rank 0 (on node 0) stops the group: the node's
    first rank in this process, the others in spawned children."""
    if args.node_rank == 0:  # (ServerArgs: node_rank < nnodes)
        raise ValueError("run_follower_node is for nodes 1..nnodes-1 (node 0 runs rank 0)")
    if args.dist_init_addr is None:
        raise ValueError("dist_init_addr: node 0's 'host:port' is required")
    local_size = ranks_per_node(args.tp_size, args.nnodes)
    first = args.node_rank * local_size  # this node's first rank
    followers = spawn_followers(args, range(first + 1, first + local_size))
    try:
        run_rank(args, first)
    finally:
        stop_followers(followers)
    failed = [child for child in followers.members if child.process.exitcode != 0]
    if failed:
        raise TPRankError(f"{failed[0].name} exited ({describe_exit(failed[0].process.exitcode)})")


def main(argv: list[str] | None = None) -> None:
    """Nodes 1..nnodes-1: `python -m minisgl.scheduler.tp --node-rank K ...`."""
    args, _ = parse_server_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    run_follower_node(args)


if __name__ == "__main__":
    # `python -m` runs this file as `__main__`, a second copy of the module: safe because nothing
    # rank 0 broadcasts (ServerArgs, an inbox's requests and messages) is defined here.
    main()
