"""The attention-backend contract: torch-native on CPU, FlashInfer on CUDA."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kvcache.pool import KVPool


@dataclass(frozen=True)
class AttentionBatch:
    """Shape of one forward, per sequence, as the backend needs it (tensors on the device).

    For sequence i: queries are the tokens at positions [prefix_lens[i], kv_lens[i]); its
    keys/values are positions [0, kv_lens[i]), found in the pool through
    `page_table[table_rows[i], :kv_lens[i]]` (token slots). Queries are laid out back to back in
    sequence order; `out_slots` ([tokens]) are where this batch's new K/V go.
    """

    table_rows: torch.Tensor  # int64 [seqs]
    prefix_lens: torch.Tensor  # int64 [seqs]
    kv_lens: torch.Tensor  # int64 [seqs]
    out_slots: torch.Tensor  # int64 [tokens]
    page_table: torch.Tensor  # int32 [max_rows, max_len], token slots
    prefix_lens_cpu: list[int]
    kv_lens_cpu: list[int]

    @property
    def extend_lens_cpu(self) -> list[int]:
        return [kv - pre for kv, pre in zip(self.kv_lens_cpu, self.prefix_lens_cpu, strict=True)]


class AttentionBackend(ABC):
    """Computes attention for a mixed batch (prefill chunks with cached prefixes, and decodes)
    directly from the paged KV pool.

    Contract: `prepare` runs once per forward and returns metadata reused by every layer;
    `forward` first stores the layer's new K/V at `batch.out_slots`, then returns attention
    output of shape [tokens, heads, head_dim] for q of shape [tokens, heads, head_dim].
    """

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scale: float,
        pool: KVPool,
        metadata: Any,
    ) -> torch.Tensor: ...
