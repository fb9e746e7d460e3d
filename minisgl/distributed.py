"""Tensor-parallel identity of this process: one of the two set-once globals (design notes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO: TPInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    if _TP_INFO is not None and _TP_INFO != TPInfo(rank, size):
        raise RuntimeError(f"tp info already set to {_TP_INFO}, cannot change to {rank}/{size}")
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} out of range for tp size {size}")
    _TP_INFO = TPInfo(rank, size)


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
