"""Attention in plain torch (SDPA) over the paged pool: the CPU path and the CUDA fallback.

Decodes (one query each) are grouped by KV length into a few padded SDPA calls; each prefill
chunk is one SDPA call, causal after its cached prefix. On CPU in fp32 the decodes go instead
to one paged-attention kernel call (minisgl/kernels) that reads K/V through the page table with
no gather or padding. The SDPA path stays the reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig, stage
from minisgl.kernels.cpu import kernels_for
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kvcache.pool import KVPool

# A decode joins the current group while its KV length is at least this fraction of the group's
# longest: every group is then at least this full, and there are at most log2(max/min) groups.
MIN_DECODE_GROUP_FILL = 0.5


@dataclass
class _Group:
    """Sequences computed in one SDPA call: one prefill chunk, or decodes of similar KV length
    (padded to the longest)."""

    token_index: Tensor | slice  # query rows: [seqs * q_len], sequence by sequence
    num_seqs: int
    kv_slots: Tensor  # int64 [seqs * kv_len] (padding points at slot 0)
    # bool, [q_len, kv_len] for a prefill chunk ([seqs, 1, 1, kv_len] for decodes); None: plain
    # causal from position 0
    mask: Tensor | None
    # Gather buffers, allocated at the first layer and reused by every layer: a fresh allocation
    # per layer costs more than the copy itself on CPU.
    k_buf: Tensor | None = None
    v_buf: Tensor | None = None


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
    # The decodes for the CPU paged-attention kernel where it applies (else they are groups).
    kernel_decodes: _KernelDecodes | None
    groups: list[_Group]


class TorchNativeBackend(AttentionBackend):
    def __init__(self, cfg: AttentionConfig | None = None) -> None:
        """Sizes nothing ahead: every buffer follows the batch. The CPU kernels compute the
        decodes when cfg says fp32 on the CPU and a head layout the kernel supports; without
        cfg, SDPA computes everything (a reference). SDPA's default scale is cfg.scale."""
        self._kernels: CpuKernels | None = None
        if cfg is not None:
            self._scale = cfg.scale
            kernels = kernels_for(cfg.device, cfg.dtype)
            heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
            if kernels is not None and kernels.supports_decode_attention(*heads):
                self._kernels = kernels

    def prepare(self, batch: AttentionBatch) -> TorchNativeMetadata:
        device = batch.out_slots.device
        decodes: list[tuple[int, int, int]] = []  # (kv_len, query row, sequence index)
        groups: list[_Group] = []
        token_start = 0
        for i, (prefix_len, kv_len) in enumerate(
            zip(batch.prefix_lens_cpu, batch.kv_lens_cpu, strict=True)
        ):
            tokens = slice(token_start, token_start + kv_len - prefix_len)
            token_start = tokens.stop
            if kv_len - prefix_len == 1:
                decodes.append((kv_len, tokens.start, i))
                continue
            mask = None
            if prefix_len > 0:
                q_pos = torch.arange(prefix_len, kv_len, device=device)
                mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
            slots = batch.page_table[batch.table_rows[i], :kv_len].long()
            groups.append(_Group(tokens, 1, slots, mask))
        if self._kernels is None or not decodes:
            return TorchNativeMetadata(batch.out_slots, None, groups + _group(batch, decodes))
        seq_index = torch.tensor([d[2] for d in decodes], dtype=torch.int64)
        kernel_decodes = _KernelDecodes(
            token_index=torch.tensor([d[1] for d in decodes], dtype=torch.int64),
            table_rows=batch.table_rows[seq_index].contiguous(),
            kv_lens=batch.kv_lens[seq_index].contiguous(),
            page_table=batch.page_table.contiguous(),
        )
        return TorchNativeMetadata(batch.out_slots, kernel_decodes, groups)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer_id: int,
        pool: KVPool,
        metadata: TorchNativeMetadata,
    ) -> Tensor:
        pool.store(layer_id, metadata.out_slots, k, v)
        k_cache, v_cache = pool.buffer[layer_id]
        out = torch.empty_like(q)
        decodes, kv_scales = metadata.kernel_decodes, pool.layer_scales[layer_id]
        if self._kernels is not None and decodes is not None:
            self._kernels.decode_attention(
                q, *decodes, k_cache, v_cache, out, self._scale, kv_scales
            )
        # The SDPA path: prefill chunks always, decodes unless the kernel computed them. SDPA
        # wants [seqs, heads, len, head_dim]; GQA repeats KV heads inside the kernel.
        for group in metadata.groups:
            if group.k_buf is None or group.v_buf is None:
                shape = (group.kv_slots.numel(), *k_cache.shape[1:])
                group.k_buf, group.v_buf = k_cache.new_empty(shape), v_cache.new_empty(shape)
            torch.index_select(k_cache, 0, group.kv_slots, out=group.k_buf)
            torch.index_select(v_cache, 0, group.kv_slots, out=group.v_buf)
            gk, gv = group.k_buf, group.v_buf
            if gk.dtype != q.dtype:  # fp8 codes times the layer's scales (16-bit pools: 1.0)
                gk, gv = (x.to(q.dtype) * s for x, s in zip((gk, gv), kv_scales, strict=True))
            # [seqs * len, heads, D] -> [seqs, heads, len, D]
            gq, gk, gv = (
                x.unflatten(0, (group.num_seqs, -1)).transpose(1, 2)
                for x in (q[group.token_index], gk, gv)
            )
            o = F.scaled_dot_product_attention(
                gq,
                gk,
                gv,
                attn_mask=group.mask,
                is_causal=group.mask is None,
                enable_gqa=True,
            )
            out[group.token_index] = o.transpose(1, 2).flatten(0, 1)
        return out


def _group(batch: AttentionBatch, decodes: list[tuple[int, int, int]]) -> list[_Group]:
    """Decodes (kv_len, query row, sequence index) as padded SDPA groups, longest first."""
    device = batch.out_slots.device
    groups: list[list[tuple[int, int, int]]] = []
    for entry in sorted(decodes, reverse=True):
        if not groups or entry[0] < MIN_DECODE_GROUP_FILL * groups[-1][0][0]:
            groups.append([])
        groups[-1].append(entry)
    result = []
    for members in groups:
        max_kv = members[0][0]
        seq_index, token_index = stage(
            device, torch.int64, [m[2] for m in members], [m[1] for m in members]
        )
        valid = torch.arange(max_kv, device=device)[None, :] < batch.kv_lens[seq_index, None]
        slots = batch.page_table[batch.table_rows[seq_index], :max_kv].long()
        mask = valid[:, None, None, :]  # [decodes, 1, 1, max_kv]
        result.append(
            _Group(token_index, len(members), slots.masked_fill(~valid, 0).flatten(), mask)
        )
    return result
