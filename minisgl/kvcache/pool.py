"""The paged KV pool: one K and one V buffer per layer, indexed by token slot.

slot = page * page_size + offset. Buffers are allocated once at start-up and reused: fresh
allocations are slow on CPU and fragment GPU memory. The pool knows shapes, not models: the
engine passes this rank's KV head count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels.cpu_ops import huge_page_zeros
from minisgl.kernels.gpu import layer_kernels


@dataclass(frozen=True)
class KVShape:
    """What one token's K/V occupies on this rank."""

    num_layers: int
    num_kv_heads: int  # on this rank (after tensor-parallel sharding)
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


class KVPool:
    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        # [layer, k/v, slot, kv_head, head_dim]
        dims = (shape.num_layers, 2, self.num_slots, shape.num_kv_heads, shape.head_dim)
        if device.type == "cpu":
            # Decode attention reads pages scattered over the pool: huge pages spare it most
            # TLB misses. Written once here, so no request pays for first-touch page faults.
            self.buffer = huge_page_zeros(dims, dtype).zero_()
        else:
            self.buffer = torch.zeros(dims, dtype=dtype, device=device)
        kernels = layer_kernels(device, dtype)
        self._store_kernels = kernels.fused or kernels.cpu  # both have the same store_kv

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 0]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 1]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this batch's new K/V ([tokens, kv_heads, head_dim]) at `slots` ([tokens]): both
        in one kernel where one applies (Triton on CUDA, the C kernels for fp32 on CPU; each
        declines layouts it does not take), else two index copies."""
        k_cache, v_cache = self.buffer[layer_id, 0], self.buffer[layer_id, 1]
        kernels = self._store_kernels
        if kernels is not None and kernels.store_kv(k, v, k_cache, v_cache, slots):
            return
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
