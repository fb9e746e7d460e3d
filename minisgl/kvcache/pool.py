"""The paged KV pool: one K and one V buffer per layer, indexed by token slot (slot = page *
page_size + offset), allocated once at start-up and reused.

An fp8 pool (--kv-cache-dtype) stores x / scale, saturated to the format's largest value, with
one K and one V scale per layer (1.0, or the checkpoint's k_scale / v_scale); readers multiply
by them (`layer_scales`: torch-native attention, and the C, Triton and FlashInfer kernels).
A 16-bit pool (bf16, fp16) holds values rounded to its format, its scales 1.0."""

from dataclasses import dataclass

import torch
from torch import Tensor

from minisgl.kernels.gpu import layer_kernels
from minisgl.kernels.weights import huge_page_zeros

# --kv-cache-dtype: vLLM's and SGLang's names ("auto": the model's dtype)
KV_CACHE_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


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
        scales: Tensor | None = None,
    ) -> None:
        """dtype: what the pool stores; scales: fp8's, [layers, 2 (k, v)] (default 1.0)."""
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        # [layer, k/v, slot, kv_head, head_dim]
        dims = (shape.num_layers, 2, self.num_slots, shape.num_kv_heads, shape.head_dim)
        if device.type == "cpu":
            # Decode attention reads pages scattered over the pool: huge pages spare it most
            # TLB misses. Left untouched, memory is committed as slots are first written.
            self.buffer = huge_page_zeros(dims, dtype)
        else:
            self.buffer = torch.zeros(dims, dtype=dtype, device=device)
        self.fp8 = dtype.itemsize == 1
        # fp8: what each layer's K and V are divided by; other pools hold values as they are
        kept = scales if self.fp8 and scales is not None else torch.ones(shape.num_layers, 2)
        self.scales = kept.float().cpu()
        self.layer_scales: list[tuple[float, float]] = [(k, v) for k, v in self.scales.tolist()]
        self._store_kernels = None if self.fp8 else layer_kernels(device, dtype)  # fp8: torch's

    def store(self, layer_id: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write this batch's new K/V ([tokens, kv_heads, head_dim]) at `slots` ([tokens]): both
        in one kernel where one applies (Triton on CUDA, the C kernels for fp32 on CPU; each
        declines layouts it does not take), else two index copies (converted to the pool's
        dtype)."""
        k_cache, v_cache = self.buffer[layer_id]
        kernels = self._store_kernels
        if kernels is not None and kernels.store_kv(k, v, k_cache, v_cache, slots):
            return
        if self.fp8:  # quantized, then copied as bytes (torch has no fp8 index_copy_ on CPU)
            top, scales = torch.finfo(k_cache.dtype).max, self.layer_scales[layer_id]
            k, v = (
                (x.float() / s).clamp_(-top, top).to(k_cache.dtype).view(torch.uint8)
                for x, s in zip((k, v), scales, strict=True)
            )
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
