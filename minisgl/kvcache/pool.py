"""The paged KV pool: one K and one V buffer per layer, indexed by token slot.

slot = page * page_size + offset. Buffers are allocated once at start-up and reused: fresh
allocations are slow on CPU and fragment GPU memory.
"""

from __future__ import annotations

import torch

from minisgl.models.config import ModelConfig
from minisgl.models.llama import local_head_counts


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        _, num_kv_heads = local_head_counts(cfg)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = cfg.head_dim
        # [layer, k/v, slot, kv_head, head_dim]
        self.buffer = torch.zeros(
            cfg.num_layers,
            2,
            self.num_slots,
            num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 0]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 1]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this batch's new K/V ([tokens, kv_heads, head_dim]) at `slots` ([tokens])."""
        self.buffer[layer_id, 0].index_copy_(0, slots, k)
        self.buffer[layer_id, 1].index_copy_(0, slots, v)


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    _, num_kv_heads = local_head_counts(cfg)
    elem = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_layers * 2 * num_kv_heads * cfg.head_dim * elem
