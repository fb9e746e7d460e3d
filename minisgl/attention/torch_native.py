"""Attention in plain torch (SDPA) over the paged pool: the CPU path and the CUDA fallback.

Decodes (one query each) are batched into one padded SDPA call; prefill chunks run one SDPA call
per sequence with a causal mask offset by the cached prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, AttentionBatch
from minisgl.kvcache.pool import KVPool


@dataclass
class _Prefill:
    token_start: int  # first query row of this sequence in the batch
    token_end: int
    kv_slots: torch.Tensor  # int64 [kv_len]
    mask: torch.Tensor | None  # bool [q_len, kv_len]; None means plain causal from position 0


@dataclass
class TorchNativeMetadata:
    out_slots: torch.Tensor
    decode_token_index: torch.Tensor  # int64 [decodes]: query rows of the decodes
    decode_kv_slots: torch.Tensor  # int64 [decodes * max_kv_len] (padding points at slot 0)
    decode_mask: torch.Tensor  # bool [decodes, 1, 1, max_kv_len]
    prefills: list[_Prefill]
    # Gather buffers for the decodes' K and V, allocated at the first layer and reused by every
    # layer: a fresh allocation per layer costs more than the copy itself on CPU.
    decode_k: torch.Tensor | None = None
    decode_v: torch.Tensor | None = None


class TorchNativeBackend(AttentionBackend):
    def prepare(self, batch: AttentionBatch) -> TorchNativeMetadata:
        device = batch.out_slots.device
        decode_rows: list[int] = []
        decode_seq: list[int] = []
        prefills: list[_Prefill] = []
        token_start = 0
        for i, (prefix_len, kv_len) in enumerate(
            zip(batch.prefix_lens_cpu, batch.kv_lens_cpu, strict=True)
        ):
            q_len = kv_len - prefix_len
            if q_len == 1:
                decode_rows.append(token_start)
                decode_seq.append(i)
            else:
                row = batch.page_table[batch.table_rows[i], :kv_len].long()
                mask = None
                if prefix_len > 0:
                    q_pos = torch.arange(prefix_len, kv_len, device=device)
                    mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
                prefills.append(_Prefill(token_start, token_start + q_len, row, mask))
            token_start += q_len

        seq_index = torch.tensor(decode_seq, dtype=torch.long, device=device)
        max_kv = max((batch.kv_lens_cpu[i] for i in decode_seq), default=0)
        kv_lens = batch.kv_lens[seq_index]
        positions = torch.arange(max_kv, device=device)
        valid = positions[None, :] < kv_lens[:, None]  # [decodes, max_kv]
        slots = batch.page_table[batch.table_rows[seq_index], :max_kv].long()
        return TorchNativeMetadata(
            out_slots=batch.out_slots,
            decode_token_index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_kv_slots=slots.masked_fill(~valid, 0).flatten(),
            decode_mask=valid[:, None, None, :],
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scale: float,
        pool: KVPool,
        metadata: TorchNativeMetadata,
    ) -> torch.Tensor:
        pool.store(layer_id, metadata.out_slots, k, v)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        out = torch.empty_like(q)
        # SDPA wants [batch, heads, len, head_dim]; GQA repeats KV heads inside the kernel.
        num_decodes = metadata.decode_token_index.numel()
        if num_decodes > 0:
            dq = q[metadata.decode_token_index].unsqueeze(2)  # [decodes, heads, 1, head_dim]
            if metadata.decode_k is None or metadata.decode_v is None:
                shape = (metadata.decode_kv_slots.numel(), *k_cache.shape[1:])
                metadata.decode_k = k_cache.new_empty(shape)
                metadata.decode_v = v_cache.new_empty(shape)
            torch.index_select(k_cache, 0, metadata.decode_kv_slots, out=metadata.decode_k)
            torch.index_select(v_cache, 0, metadata.decode_kv_slots, out=metadata.decode_v)
            # [decodes * L, kv_heads, D] -> [decodes, kv_heads, L, D]
            dk = metadata.decode_k.view(num_decodes, -1, *k_cache.shape[1:]).transpose(1, 2)
            dv = metadata.decode_v.view(num_decodes, -1, *v_cache.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                dq, dk, dv, attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True
            )
            out[metadata.decode_token_index] = o.squeeze(2)
        for p in metadata.prefills:
            pq = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            pk = k_cache[p.kv_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, kv_len, D]
            pv = v_cache[p.kv_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                pq, pk, pv, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[p.token_start : p.token_end] = o.squeeze(0).transpose(0, 1)
        return out
