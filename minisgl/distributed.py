"""Tensor-parallel identity of this process: one of the two set-once globals (design notes).

Also the process-group lifecycle. Every rank joins two groups: the default group carries the
model's collectives (NCCL on CUDA, gloo on CPU), and a gloo "control" group carries pickled
Python objects (requests, commands) from rank 0 so they never interleave with a forward pass
that runs concurrently on the overlap worker thread.
"""

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives inside a forward (and start-up) fail after this long instead of hanging forever:
# long enough for a slow rank to finish loading weights, short enough to notice a wedged peer.
COLLECTIVE_TIMEOUT_S = 60.0
# Ranks 1..N-1 wait on the control group for rank 0's next command, and an idle server may send
# none for days. A dead rank 0 is still noticed at once: gloo fails a pending op when the TCP
# connection closes. (Gloo timeouts are per process: rank 0's sends keep the short one.)
FOLLOWER_CONTROL_TIMEOUT_S = 365 * 24 * 3600.0
LOOPBACK_HOST = "127.0.0.1"


class TPRankError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the tp group is no longer usable."""


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1


_TP_INFO: TPInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    if _TP_INFO is not None and TPInfo(rank, size) != _TP_INFO:
        raise RuntimeError(f"tp info already set to {_TP_INFO}, cannot change to {rank}/{size}")
    # (ranks come from ServerArgs, which checks node_rank < nnodes)
    _TP_INFO = TPInfo(rank, size)


def reset_tp_info() -> None:
    """Forget the tp identity: after `destroy_distributed`, the process may start over (tests)."""
    global _TP_INFO
    _TP_INFO = None


def get_tp_info() -> TPInfo:
    # Single-process use (offline API, tests of layers) never sets it: that is tp size 1.
    return _TP_INFO if _TP_INFO is not None else TPInfo()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp size ({denominator})")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_info().size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    size = get_tp_info().size
    if size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous())
    return torch.cat(shards, dim=-1)


def broadcast_from_primary(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's copy of x on every rank (x is left untouched when tp size is 1)."""
    if get_tp_info().size == 1 or x.numel() == 0:  # shapes agree across ranks: all skip alike
        return x
    x = x.contiguous()
    dist.broadcast(x, src=0)
    return x


# ---- process groups ----------------------------------------------------------------------------

_CONTROL_GROUP: dist.ProcessGroup | None = None


def ranks_per_node(tp_size: int, nnodes: int) -> int:
    if tp_size % nnodes != 0:
        raise ValueError(f"tp size ({tp_size}) is not divisible by the number of nodes ({nnodes})")
    return tp_size // nnodes


def free_loopback_addr() -> str:
    """A 'host:port' rendezvous on this machine (the OS picks a free port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK_HOST, 0))
        return f"{LOOPBACK_HOST}:{s.getsockname()[1]}"


def init_distributed(rank: int, size: int, init_addr: str, backend: str, local_rank: int) -> None:
    """Join the tp group of `size` ranks that meets at `init_addr` ("host:port", rank 0 listens).

    backend: "gloo" (CPU) or "nccl" (CUDA; this rank uses device cuda:{local_rank}).
    """
    global _CONTROL_GROUP
    set_tp_info(rank, size)
    host, sep, port = init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr: expected 'host:port', got {init_addr!r}")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size, timeout=timeout
    )
    control_timeout_s = COLLECTIVE_TIMEOUT_S if rank == 0 else FOLLOWER_CONTROL_TIMEOUT_S
    _CONTROL_GROUP = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s)
    )


def control_group() -> dist.ProcessGroup:
    if _CONTROL_GROUP is None:
        raise RuntimeError("init_distributed has not been called in this process")
    return _CONTROL_GROUP


def destroy_distributed() -> None:
    """Leave the process groups (safe to call twice, or when a peer is already dead)."""
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_tp_info()
