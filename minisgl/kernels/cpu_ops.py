"""Typed wrappers over the fp32 CPU kernels' library (csrc/), called through ctypes: a tensor
or packed weight goes as its address (the signatures are in cpu_abi.py, the weight layouts in
weights.py).
`minisgl.kernels.cpu` builds and loads the library (see there for why these kernels).
"""

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from minisgl.kernels.cpu_abi import (
    ATTN_MAX_HEAD_DIM,
    ATTN_MAX_HEADS,
    KV_FORMATS,
    StackShape,
)
from minisgl.kernels.weights import PackedLinear, huge_page_zeros


def _rows(x: Tensor) -> tuple[Tensor, int]:
    """A 2-D x with contiguous rows (a copy only when they are not) and its row stride."""
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x, x.stride(0)


def _heads_stride(x: Tensor) -> int | None:
    """Token stride of a [tokens, heads, head_dim] view whose heads lie back to back, else None."""
    if x.dim() != 3 or x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        return None
    return x.stride(0)


class CpuKernels:
    """Typed wrappers over the library. Inputs are fp32 CPU tensors; each method documents the
    layouts it accepts. Made by `minisgl.kernels.cpu.get()` once the library passed its
    self-check."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """lib: as `cpu_abi.load` returns it."""
        self._lib = lib
        self.block_n = int(lib.mg_block_n())

    # ---- linear ----------------------------------------------------------------------------

    def pack(self, weight: Tensor) -> PackedLinear:
        out_features, in_features = weight.shape
        num_panels = -(-out_features // self.block_n)
        panels = huge_page_zeros((num_panels, in_features, self.block_n), weight.dtype)
        # [out, in] -> [panels, in, block_n], the rows past out_features zero
        padded = F.pad(weight, (0, 0, 0, num_panels * self.block_n - out_features))
        panels.copy_(padded.view(num_panels, self.block_n, in_features).transpose(1, 2))
        return PackedLinear(panels, out_features, in_features)

    def serves_blocks(self, qtype: int) -> bool:
        return self._lib.mg_quant_block_bytes(qtype) > 0

    def set_int8_activations(self, on: bool) -> bool:
        """GGUF blocks times activations quantized to int8 (llama.cpp's numerics: Q4_K / Q6_K /
        Q8_0 with AVX2, Q4_0 / Q4_1 too with AVX-512 VNNI), or fp32 ones (the default: see
        csrc/quant_int8.c). Process-wide; returns whether the int8 path is on now."""
        return bool(self._lib.mg_set_int8_activations(int(on)))

    def embed(self, weight: PackedLinear, ids: Tensor) -> Tensor:
        """Rows `ids` (int64) of a block weight, dequantized: [len(ids), in_features] fp32."""
        ids = ids.contiguous()
        out = torch.empty(*ids.shape, weight.in_features)
        self._lib.mg_embed(
            weight,
            weight.in_features,
            ids,
            ids.numel(),
            out,
        )
        return out

    def linear(
        self,
        x: Tensor,
        weight: PackedLinear,
        bias: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """x [..., in] -> [..., out] = x @ W^T + bias; into `out` ([rows, out], contiguous)
        when given."""
        lead = x.shape[:-1]
        x2, ldx = _rows(x.reshape(-1, weight.in_features))
        num_rows = x2.shape[0]
        y = torch.empty(num_rows, weight.out_features, dtype=x.dtype) if out is None else out
        assert y.shape == (num_rows, weight.out_features) and y.is_contiguous()
        if num_rows:
            self._lib.mg_linear(
                x2,
                ldx,
                weight,
                bias,
                y,
                weight.out_features,
                num_rows,
                weight.in_features,
                weight.out_features,
            )
        return y.view(*lead, weight.out_features)

    # ---- elementwise -----------------------------------------------------------------------

    def rmsnorm(
        self,
        x: Tensor,
        weight: Tensor,
        eps: float,
        residual: Tensor | None = None,
    ) -> Tensor:
        """RMSNorm of x [tokens, hidden]; with `residual` (contiguous, same shape) it normalizes
        x + residual and stores that sum into `residual` (the fused residual add)."""
        x, ldx = _rows(x)
        num_tokens, hidden = x.shape
        out = torch.empty(num_tokens, hidden, dtype=x.dtype)
        assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
        self._lib.mg_rmsnorm(
            x,
            ldx,
            1,
            residual,
            hidden,
            weight,
            out,
            hidden,
            num_tokens,
            hidden,
            eps,
        )
        return out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """[tokens, 2 * inter] -> silu(gate) * up, [tokens, inter]."""
        gate_up, ld = _rows(gate_up)
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype)
        self._lib.mg_silu_mul(
            gate_up,
            ld,
            out,
            inter,
            num_tokens,
            inter,
        )
        return out

    def qk_norm_rope(
        self,
        q: Tensor,
        k: Tensor,
        positions: Tensor,
        cos_cache: Tensor,
        sin_cache: Tensor,
        q_weight: Tensor | None,
        k_weight: Tensor | None,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        """layers/rope.py's `qk_norm_rope` in place: per-head RMSNorm of q [tokens, heads, D]
        and k [tokens, kv_heads, D] (none when the weights are None), then the rotation by the
        cos/sin rows ([max_pos, D], contiguous) of int64 `positions`. Returns q and k (copies
        first where a token's heads do not lie back to back)."""
        q, k = (x if _heads_stride(x) is not None else x.contiguous() for x in (q, k))
        if q_weight is not None and k_weight is not None:
            for x, weight in ((q, q_weight), (k, k_weight)):
                ld = x.stride(0)
                num_tokens, heads, head_dim = x.shape
                self._lib.mg_rmsnorm(
                    x,
                    ld,
                    heads,
                    None,
                    0,
                    weight,
                    x,
                    ld,
                    num_tokens,
                    head_dim,
                    eps,
                )
        positions = positions.contiguous()
        self._lib.mg_rope(
            q,
            q.stride(0),
            q.shape[1],
            k,
            k.stride(0),
            k.shape[1],
            q.shape[0],
            q.shape[2],
            positions,
            cos_cache,
            sin_cache,
        )
        return q, k

    def seeded_uniform(self, seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
        """minisgl.engine.sampler.seeded_uniform, bit for bit: [rows, vocab] uniforms for int64
        seeds and positions [rows]."""
        seeds, positions = seeds.contiguous(), positions.contiguous()
        out = torch.empty(seeds.numel(), vocab_size, dtype=torch.float32)
        self._lib.mg_seeded_uniform(
            seeds,
            positions,
            seeds.numel(),
            vocab_size,
            out,
        )
        return out

    def sample(
        self,
        logits: Tensor,
        temperatures: Tensor,
        seeds: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """Token ids [rows] (int64): argmax of softmax(logits / t) / -log(u) per row, u the seeded
        uniforms, greedy where the temperature is 0 (sampler.sample without filters)."""
        logits, ld = _rows(logits)
        temperatures = temperatures.contiguous()
        seeds, positions = seeds.contiguous(), positions.contiguous()
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.mg_sample(
            logits,
            ld,
            temperatures,
            seeds,
            positions,
            rows,
            vocab,
            out,
        )
        return out

    # ---- KV pool and attention -------------------------------------------------------------

    def store_kv(
        self,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slots: Tensor,
    ) -> bool:
        """k_cache[slots] = k and v_cache[slots] = v for k, v [tokens, kv_heads, D] and caches
        [slots, kv_heads, D] (contiguous). False, untouched, for other layouts."""
        ldk, ldv = _heads_stride(k), _heads_stride(v)
        if ldk is None or ldv is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        slots = slots.contiguous()
        self._lib.mg_store_kv(
            k,
            ldk,
            v,
            ldv,
            k_cache,
            v_cache,
            slots,
            k.shape[0],
            k.shape[1] * k.shape[2],
        )
        return True

    def decode_attention(
        self,
        q: Tensor,
        q_rows: Tensor,
        table_rows: Tensor,
        kv_lens: Tensor,
        page_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """For decode i: out[q_rows[i]] = attention of q[q_rows[i]] ([heads, D]) over positions
        [0, kv_lens[i]) of page-table row table_rows[i], read from the pool's slots.
        q, out: [tokens, heads, D] (out with heads back to back); caches [slots, kv_heads, D],
        contiguous, fp32 or a KV_FORMATS dtype (values times `kv_scales`); int64 index tensors; the
        int32 page table with contiguous rows. Callers check `supports_decode_attention` first."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        q = q if _heads_stride(q) is not None else q.contiguous()
        ldq, ldo = q.stride(0), _heads_stride(out)
        assert ldo is not None and page_table.stride(1) == 1 and k_cache.is_contiguous()
        self._lib.mg_decode_attention(
            q,
            ldq,
            q_rows,
            k_cache,
            v_cache,
            page_table,
            page_table.stride(0),
            table_rows,
            kv_lens,
            out,
            ldo,
            q_rows.numel(),
            num_heads,
            k_cache.shape[1],
            head_dim,
            scale * kv_scales[0],
            KV_FORMATS.get(k_cache.dtype, 0),
            kv_scales[1],
        )

    def chunk_attention(
        self,
        q: Tensor,
        out: Tensor,
        slots: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        kv_scales: tuple[float, float],
    ) -> None:
        """A prefill chunk's causal attention: q, out [n, heads, D] are the last n positions of
        those whose K/V sit at `slots` (int32, contiguous); layouts as `decode_attention`'s."""
        q = q if _heads_stride(q) is not None else q.contiguous()
        self._lib.mg_chunk_attention(
            q,
            q.stride(0),
            k_cache,
            v_cache,
            slots,
            slots.numel() - q.shape[0],
            q.shape[0],
            out,
            _heads_stride(out),
            q.shape[1],
            k_cache.shape[1],
            q.shape[2],
            scale * kv_scales[0],
            KV_FORMATS.get(k_cache.dtype, 0),
            kv_scales[1],
        )

    def decode_layers(
        self,
        stack: StackShape,
        hidden: Tensor,
        positions: Tensor,
        out_slots: Tensor,
        page_table: Tensor,
        table_rows: Tensor,
        kv_lens: Tensor,
        pool_buffer: Tensor,
        kv_scales: Tensor,
        op_seconds: Tensor | None = None,
    ) -> None:
        """Run every layer of a dense stack for a decode-only batch (see mg_decode_layers):
        hidden [seqs, hidden] (contiguous) holds the embeddings and receives the last layer's
        output plus the residual. Index tensors are int64 [seqs], contiguous; the pool buffer
        is [layers, 2, slots, kv_heads, head_dim], contiguous, fp32 or a KV_FORMATS dtype (times
        `kv_scales`, float32 [layers, 2], contiguous). `op_seconds` (float64
        [len(DECODE_OPS)]), when given, accumulates each op's wall time over the layers."""
        num_seqs, stack_ptr = hidden.shape[0], ctypes.addressof(stack)
        scratch = torch.empty(int(self._lib.mg_decode_scratch_floats(stack_ptr, num_seqs)))
        self._lib.mg_decode_layers(
            stack_ptr,
            hidden,
            num_seqs,
            positions,
            out_slots,
            page_table,
            page_table.stride(0),
            table_rows,
            kv_lens,
            pool_buffer,
            pool_buffer.shape[2],
            KV_FORMATS.get(pool_buffer.dtype, 0),
            kv_scales,
            scratch,
            op_seconds,
        )

    @staticmethod
    def supports_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        whole_groups = num_heads % num_kv_heads == 0
        return whole_groups and num_heads <= ATTN_MAX_HEADS and head_dim <= ATTN_MAX_HEAD_DIM
