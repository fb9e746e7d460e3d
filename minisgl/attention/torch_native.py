"""Attention in plain torch (SDPA) over the paged pool: the CPU path and the CUDA fallback.

Each sequence is one SDPA call over its K/V gathered from the pool, causal after its cached
prefix. On CPU in fp32 the C kernels (minisgl/kernels) take over, reading K/V through the page
table with no gather, mask or padding: one call for every decode of the batch, one per prefill
chunk. The SDPA path stays the reference."""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig
from minisgl.kernels.cpu import kernels_for
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kvcache.pool import KVPool


class _Sequence(NamedTuple):
    """One sequence's SDPA call."""

    token_index: slice  # query rows
    kv_slots: Tensor  # int64 [kv_len]
    mask: Tensor | None  # bool [q_len, kv_len] after a cached prefix; None: causal from 0


class _KernelDecodes(NamedTuple):
    """Every decode of the batch, for the CPU paged-attention kernel (int64, one per decode), in
    the order `CpuKernels.decode_attention` takes them."""

    token_index: Tensor  # query rows
    table_rows: Tensor
    kv_lens: Tensor
    page_table: Tensor  # int32 [rows, width], contiguous


@dataclass
class TorchNativeMetadata:
    out_slots: Tensor
    kernel_decodes: _KernelDecodes | None  # where the CPU kernels apply: every decode,
    kernel_chunks: list[tuple[slice, Tensor]]  # and each prefill chunk (rows, int32 slots)
    sequences: list[_Sequence]  # the rest, through SDPA


class TorchNativeBackend(AttentionBackend):
    def __init__(self, cfg: AttentionConfig | None = None) -> None:
        """Sizes nothing ahead: every buffer follows the batch. The CPU kernels compute when cfg
        says fp32 on the CPU and a head layout the kernels support; without cfg, SDPA computes
        everything (a reference). SDPA's default scale is cfg.scale."""
        self._kernels: CpuKernels | None = None
        if cfg is not None:
            self._scale = cfg.scale
            kernels = kernels_for(cfg.device, cfg.dtype)
            heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
            if kernels is not None and kernels.supports_decode_attention(*heads):
                self._kernels = kernels

    def prepare(self, batch: AttentionBatch) -> TorchNativeMetadata:
        device = batch.out_slots.device
        decodes: list[tuple[int, int]] = []  # (query row, sequence index)
        chunks: list[tuple[slice, Tensor]] = []
        sequences: list[_Sequence] = []
        token_start = 0
        for i, (prefix_len, kv_len) in enumerate(
            zip(batch.prefix_lens_cpu, batch.kv_lens_cpu, strict=True)
        ):
            tokens = slice(token_start, token_start + kv_len - prefix_len)
            token_start = tokens.stop
            if self._kernels is not None and kv_len - prefix_len == 1:
                decodes.append((tokens.start, i))
                continue
            slots = batch.page_table[batch.table_rows[i], :kv_len]
            if self._kernels is not None:
                chunks.append((tokens, slots))
            else:
                mask = None
                if prefix_len > 0:  # query i (at position prefix_len + i) sees keys 0 .. its own
                    ones = torch.ones(kv_len - prefix_len, kv_len, dtype=torch.bool, device=device)
                    mask = ones.tril(prefix_len)
                sequences.append(_Sequence(tokens, slots.long(), mask))
        kernel_decodes = None
        if decodes:
            token_index, seq_index = torch.tensor(decodes, dtype=torch.int64).T.contiguous()
            kernel_decodes = _KernelDecodes(
                token_index=token_index,
                table_rows=batch.table_rows[seq_index].contiguous(),
                kv_lens=batch.kv_lens[seq_index].contiguous(),
                page_table=batch.page_table.contiguous(),
            )
        return TorchNativeMetadata(batch.out_slots, kernel_decodes, chunks, sequences)

    def attend(
        self, q: Tensor, layer_id: int, pool: KVPool, metadata: TorchNativeMetadata
    ) -> Tensor:
        k_cache, v_cache = pool.buffer[layer_id]
        out = torch.empty_like(q)
        kernels, kv_scales = self._kernels, pool.layer_scales[layer_id]
        if kernels is not None:
            if metadata.kernel_decodes is not None:
                kernels.decode_attention(
                    q, *metadata.kernel_decodes, k_cache, v_cache, out, self._scale, kv_scales
                )
            for tokens, slots in metadata.kernel_chunks:
                kernels.chunk_attention(
                    q[tokens], out[tokens], slots, k_cache, v_cache, self._scale, kv_scales
                )
        for seq in metadata.sequences:
            gk, gv = k_cache[seq.kv_slots], v_cache[seq.kv_slots]
            if gk.dtype != q.dtype:  # fp8 codes times the layer's scales (16-bit pools: 1.0)
                gk, gv = (x.to(q.dtype) * s for x, s in zip((gk, gv), kv_scales, strict=True))
            # [len, heads, D] -> [1, heads, len, D]; GQA repeats KV heads inside the kernel
            gq, gk, gv = (x.transpose(0, 1)[None] for x in (q[seq.token_index], gk, gv))
            o = F.scaled_dot_product_attention(
                gq, gk, gv, attn_mask=seq.mask, is_causal=seq.mask is None, enable_gqa=True
            )
            out[seq.token_index] = o[0].transpose(0, 1)
        return out
