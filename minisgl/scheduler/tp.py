"""Tensor parallelism across processes: rank 0 drives, ranks 1..N-1 follow.

Every rank holds a shard of the model and runs its own `Scheduler`, fed the same calls in the same
order, so batches, page tables and radix trees stay identical on all ranks without ever being
compared. Rank 0 (`TPScheduler`, a `Scheduler` subclass) queues the requests and aborts it
is given; at the start of each step it broadcasts them as one `Command` over the gloo control
group, then every rank applies them and calls `step()`. Inside the step the model's collectives
keep the shards in lockstep, and the engine broadcasts rank 0's sampled tokens.

Processes: rank 0 runs in the caller's process (the offline `LLM`, or the server's scheduler
process); the other ranks of node 0 are "spawn"ed children. With --nnodes > 1, node k > 0 runs
`python -m minisgl.scheduler.tp --node-rank k ...` (`run_follower_node`), which runs its ranks
the same way. docs/tensor_parallel.md has the whole story.

Failure: a rank that dies closes its sockets, so the next collective fails at once (gloo), and
rank 0 checks its children are alive before each broadcast; a wedged rank trips the collective
timeout. Either way rank 0 raises `TPRankError` instead of hanging.

This module is rank 0 and the per-node entry point; the command protocol, the followers' loop,
the spawned processes and nodes k > 0 live in `minisgl.scheduler.tp_ranks`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch

from minisgl.config import ServerArgs
from minisgl.core import Req, ReqOutput
from minisgl.distributed import (
    destroy_distributed,
    free_loopback_addr,
    init_distributed,
    ranks_per_node,
    reset_tp_info,
    set_tp_info,
)
from minisgl.models.llama import local_head_counts
from minisgl.models.model_config import load_model_config
from minisgl.models.resolve import resolve_model_path_for
from minisgl.runtime.supervisor import Children, StartupError
from minisgl.scheduler import tp_ranks
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp_ranks import AbortOp, AddOp, Command, Op, TPRankError, broadcast
from minisgl.server import parse_server_args
from minisgl.stats import SchedulerStats

logger = logging.getLogger(__name__)

# Followers past the engine's start-up all-reduce only allocate tables: they report soon after.
READY_TIMEOUT_S = 120.0
# How long to wait for a crashed follower to be reaped, so the error can name it.
DEATH_GRACE_S = 1.0

_T = TypeVar("_T")


def make_scheduler(args: ServerArgs) -> Scheduler:
    """The scheduler `args` ask for: with tp_size > 1, rank 0 of a tp group (a Scheduler too)."""
    return TPScheduler(args) if args.tp_size > 1 else Scheduler(args)


def _abandon(followers: Children) -> None:
    """Finalizer of a TPScheduler dropped without shutdown(): no stray processes, no stale group."""
    followers.stop(tp_ranks.KILL_TIMEOUT_S)
    destroy_distributed()


# ---- rank 0 --------------------------------------------------------------------------------------


class TPScheduler(Scheduler):
    """Rank 0 of a tp group: a `Scheduler` (a drop-in when tp_size > 1) whose calls reach every
    rank. Calls made between steps are queued and take effect, on every rank, at the next
    `step()`; `validate` and `add_request` still raise ValueError at once for a request that
    cannot run. Introspection (stats, page accounting) is rank 0's view: the others hold the
    same state.
    """

    def __init__(self, args: ServerArgs) -> None:
        if args.tp_size < 2:
            raise ValueError("TPScheduler needs tp_size >= 2 (use Scheduler for tp_size 1)")
        if args.node_rank != 0:
            raise ValueError(
                f"node_rank {args.node_rank}: rank 0 runs on node 0; other nodes run "
                "`python -m minisgl.scheduler.tp --node-rank K ...`"
            )
        if args.nnodes > 1 and args.dist_init_addr is None:
            raise ValueError("dist_init_addr: node 0's 'host:port' is required when nnodes > 1")
        args = args.replace(dist_init_addr=args.dist_init_addr or free_loopback_addr())
        assert args.dist_init_addr is not None
        self._pending: list[Op] = []
        self._closed = False
        self._broken: str | None = None  # why the group is unusable, once it is
        self._previous_threads = torch.get_num_threads()

        # Before any process starts: a model that cannot be split fails here, with the numbers
        # (leaving the tp info set to rank 0 of tp_size; reset on failure).
        local_size = ranks_per_node(args.tp_size, args.nnodes)
        set_tp_info(0, args.tp_size)
        try:
            local_head_counts(load_model_config(resolve_model_path_for(args)))
            self._followers = tp_ranks.spawn_followers(args, range(1, local_size))
        except BaseException:
            reset_tp_info()
            raise
        self._finalizer = weakref.finalize(self, _abandon, self._followers)
        try:
            # Every child runs our code first: one that dies while Python bootstraps it would
            # otherwise leave rank 0 waiting for the whole rendezvous timeout.
            self._followers.wait(lambda child: child.started, READY_TIMEOUT_S)
            init_distributed(0, args.tp_size, args.dist_init_addr, tp_ranks.dist_backend(args), 0)
            broadcast(args)
            torch.set_num_threads(tp_ranks.cpu_threads_per_rank(args))
            super().__init__(args)
            self._followers.wait(lambda child: child.ready, READY_TIMEOUT_S)
        except BaseException as exc:
            failure = self._followers.failure(wait_s=DEATH_GRACE_S)
            self._finalizer()  # kill followers, leave the group
            torch.set_num_threads(self._previous_threads)
            if not isinstance(exc, TPRankError) and (failure or isinstance(exc, StartupError)):
                raise TPRankError(f"tensor parallelism failed to start: {failure or exc}") from exc
            raise
        logger.info("tp group of %d ranks ready (rendezvous %s)", args.tp_size, args.dist_init_addr)

    @property
    def follower_pids(self) -> list[int]:
        """This node's follower processes (tests kill one to check failure handling)."""
        return [child.process.pid for child in self._followers.members if child.process.pid]

    # ---- requests in: queued, broadcast with the next step -----------------------------------

    def add_request(self, req: Req) -> None:
        self.validate(req)  # reject now, on rank 0, before it is broadcast anywhere
        self._pending.append(AddOp(req))

    def abort_request(self, rid: str) -> None:
        self._pending.append(AbortOp(rid))

    # ---- the loop ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._pending) or super().has_work()

    def step(self) -> list[ReqOutput]:
        ops, self._pending = tuple(self._pending), []
        self._send(Command("step", ops))
        return self._guarded(lambda: self._apply_and_step(ops))

    def _apply_and_step(self, ops: tuple[Op, ...]) -> list[ReqOutput]:
        tp_ranks.apply_ops(self, ops)
        return super().step()

    def fail_running(self, error: str) -> list[ReqOutput]:
        """A failed step may have left the ranks disagreeing: a tp group does not go on."""
        raise TPRankError(f"tensor-parallel group cannot recover from a failed step: {error}")

    def flush_cache(self) -> None:
        if self.has_work():
            raise RuntimeError("flush_cache needs an idle scheduler")
        self._send(Command("flush"))
        self._guarded(super().flush_cache)

    def _send(self, command: Command) -> None:
        self.check_health()
        try:
            broadcast(command)
        except Exception as exc:
            self._break_after(exc, "rank 0 could not send to the other ranks")

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        self._raise_if_broken()
        try:
            return fn()
        except Exception as exc:
            # Whatever failed, the ranks may now disagree: the group cannot go on.
            self._break_after(exc, "rank 0")

    def _break_after(self, exc: Exception, where: str) -> NoReturn:
        """Break the group over `exc`, blamed on a follower that died, if one did."""
        failure = self._followers.failure(wait_s=DEATH_GRACE_S)
        self._break(failure or f"{where}: {type(exc).__name__}: {exc}", exc)

    def check_health(self) -> None:
        """Raise TPRankError if a rank on this node has died (the idle server calls this: with no
        step to run there is no collective that would fail)."""
        self._raise_if_broken()
        if (failure := self._followers.failure()) is not None:
            self._break(failure)

    def _break(self, failure: str, cause: BaseException | None = None) -> NoReturn:
        self._broken = failure
        raise TPRankError(f"tensor-parallel group broken: {failure}") from cause

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise RuntimeError("the TPScheduler is shut down")
        if self._broken is not None:
            raise TPRankError(f"tensor-parallel group broken: {self._broken}")

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        queued = sum(isinstance(op, AddOp) for op in self._pending)
        return dataclasses.replace(stats, num_queue_reqs=stats.num_queue_reqs + queued)

    def shutdown(self) -> None:
        """Stop every rank and leave the group. Idempotent; never hangs on a dead rank."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None and self._followers.failure() is None:
            try:
                broadcast(Command("stop"))  # queued ops are dropped: nobody waits for them
            except Exception as exc:
                logger.warning("tp shutdown: could not reach the followers: %s", exc)
        try:
            super().shutdown()
        except Exception as exc:  # the in-flight batch needed a rank that is gone
            logger.warning("tp shutdown: rank 0 drain failed: %s", exc)
        # Leaving first closes our sockets: followers not told to stop (the group broke) and
        # still waiting on rank 0 see the connection close and exit, instead of being killed.
        destroy_distributed()
        tp_ranks.stop_followers(self._followers)
        self._finalizer()
        torch.set_num_threads(self._previous_threads)


def main(argv: list[str] | None = None) -> None:
    """Nodes 1..nnodes-1: `python -m minisgl.scheduler.tp --node-rank K ...`."""
    args, _ = parse_server_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    tp_ranks.run_follower_node(args)


if __name__ == "__main__":
    # `python -m` runs this file as `__main__`, a second copy of the module: safe because every
    # class rank 0 pickles (`Command`, `AddOp`, ...) lives in tp_ranks, imported once by both.
    main()
