"""Fused elementwise kernels for the GPU decoder layer, in Triton: `rmsnorm` (with the residual
add), `qk_norm_rope` (Qwen3's per-head q/k norm and rope, all heads of a token), `silu_mul` and
`store_kv`, each one pass instead of a dozen small torch kernels (docs/architecture.md, "Fused
layer kernels").

They round where the torch reference does (16-bit intermediates included), so outputs match it
up to a mean's summation order. Imported lazily; tests run them under TRITON_INTERPRET=1."""

import triton
import triton.language as tl
from torch import Tensor

# Rows wider than this many elements take 8 warps (an RMSNorm over hidden 4096+).
WIDE_ROW = 4096


def _num_warps(block: int) -> int:
    return 8 if block >= WIDE_ROW else 4


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype (to nearest, ties to even), returned in fp32: where the torch
    reference materialises a 16-bit tensor. bf16 by hand: Triton's interpreter truncates in
    `.to(tl.bfloat16)`, and the tests run there."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


# ---- RMSNorm, with the residual add -------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * residual_row_stride + cols
        res = tl.load(residual_row, mask=mask, other=0.0)
        # `x + residual` in their dtype: the sum the next layer's residual carries.
        x32 = _round(x.to(tl.float32) + res.to(tl.float32), res.dtype)
        tl.store(residual_row, x32.to(res.dtype), mask=mask)
    else:
        x32 = x.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
    normed = _round(x32 * inv_rms, dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * normed, dtype)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(dtype), mask=mask)


def unit_stride_rows(x: Tensor) -> Tensor:
    """x as 2-D rows with unit column stride (a view when it already is one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim of x (any leading shape): a new tensor of x's dtype. With
    `residual` (2-D rows with unit column stride, x's shape) it normalizes x + residual and
    stores that sum into `residual` (the fused residual add)."""
    x2 = unit_stride_rows(x)
    out = x2.new_empty(x2.shape)
    if residual is not None:
        assert residual.dim() == 2 and residual.stride(-1) == 1 and residual.shape == x.shape
    res = x2 if residual is None else residual  # read only with a residual
    num_rows, num_cols = x2.shape
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        _rmsnorm_kernel[(num_rows,)](
            x2,
            res,
            weight,
            out,
            x2.stride(0),
            res.stride(0),
            out.stride(0),
            num_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out.view(x.shape)


# ---- per-head q/k norm + rotary embedding --------------------------------------------------------


@triton.jit
def _norm_rope_heads(
    in_ptr,  # this token's first head
    out_ptr,
    weight_ptr,
    cos,  # [1, BLOCK_D] fp32, rounded to the input dtype
    sin,
    num_heads,
    head_stride,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    half = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (d < half)
    lo_ptr = in_ptr + heads * head_stride + d
    x1 = tl.load(lo_ptr, mask=mask, other=0.0)
    x2 = tl.load(lo_ptr + half, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(weight_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        a = _round(w1 * _round(a * inv_rms[:, None], dtype), dtype)
        b = _round(w2 * _round(b * inv_rms[:, None], dtype), dtype)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum are
    # rounded to the dtype, as the reference computes them in it.
    lo = _round(_round(a * cos, dtype) + _round(-b * sin, dtype), dtype)
    hi = _round(_round(b * cos, dtype) + _round(a * sin, dtype), dtype)
    out_lo = out_ptr + heads * HEAD_DIM + d
    tl.store(out_lo, lo.to(dtype), mask=mask)
    tl.store(out_lo + half, hi.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cos_stride,
    num_q_heads,
    num_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)[None, :]
    # The cache holds cat([freqs, freqs]): both halves of a row share the first half's values.
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * cos_stride + d, mask=d < half, other=0.0)
    sin = tl.load(sin_ptr + pos * cos_stride + d, mask=d < half, other=0.0)
    cos = _round(cos.to(tl.float32), dtype)
    sin = _round(sin.to(tl.float32), dtype)
    _norm_rope_heads(
        q_ptr + token * q_token_stride,
        q_out_ptr + token * num_q_heads * HEAD_DIM,
        q_weight_ptr,
        cos,
        sin,
        num_q_heads,
        q_head_stride,
        eps,
        HEAD_DIM,
        BLOCK_HQ,
        BLOCK_D,
        HAS_NORM,
    )
    _norm_rope_heads(
        k_ptr + token * k_token_stride,
        k_out_ptr + token * num_kv_heads * HEAD_DIM,
        k_weight_ptr,
        cos,
        sin,
        num_kv_heads,
        k_head_stride,
        eps,
        HEAD_DIM,
        BLOCK_HK,
        BLOCK_D,
        HAS_NORM,
    )


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(rope(norm(q)), rope(norm(k))) as new contiguous tensors; no norm when the weights are
    None. q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], each head's values
    contiguous (views into the fused qkv projection are fine); positions: [tokens];
    cos/sin caches: fp32 [max_positions, head_dim] (layers/rope.py)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    assert cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    has_norm = q_weight is not None and k_weight is not None
    half = head_dim // 2
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_cache,
            sin_cache,
            q_weight if has_norm else q,
            k_weight if has_norm else k,
            *q.stride()[:2],
            *k.stride()[:2],
            cos_cache.stride(0),
            num_q_heads,
            num_kv_heads,
            eps,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            HAS_NORM=has_norm,
            num_warps=4,
        )
    return q_out, k_out


# ---- SiLU and mul -------------------------------------------------------------------------------

SILU_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, gate_up_row_stride, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_up_ptr + row * gate_up_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_row_stride + num_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # F.silu(gate) is materialised in the dtype, then multiplied by up in it.
    act = _round(g / (1.0 + tl.exp(-g)), gate.dtype)
    out = _round(act * up.to(tl.float32), gate.dtype)
    tl.store(out_ptr + row * num_cols + cols, out.to(gate.dtype), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [rows, 2 * n] -> [rows, n]."""
    x = unit_stride_rows(gate_up)
    num_rows, width = x.shape
    num_cols = width // 2
    out = x.new_empty(num_rows, num_cols)
    if num_rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(num_cols))
        grid = (num_rows, triton.cdiv(num_cols, block))
        _silu_mul_kernel[grid](x, out, x.stride(0), num_cols, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], num_cols)


# ---- KV store -----------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_token_stride,
    v_token_stride,
    row_size,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < row_size
    k = tl.load(k_ptr + token * k_token_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * row_size + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * row_size + cols, v, mask=mask)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
) -> bool:
    """k_cache[slots] = k and v_cache[slots] = v in one kernel. k, v: [tokens, kv_heads,
    head_dim]; caches: contiguous [slots, kv_heads, head_dim]. False (nothing written) when a
    token's heads are not one contiguous run, for the caller's fallback."""
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:]
    num_tokens = k.shape[0]
    row_size = k.shape[1] * k.shape[2]
    heads_back_to_back = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v))
    if not (heads_back_to_back and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if num_tokens == 0:
        return True
    block = triton.next_power_of_2(row_size)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        row_size,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return True
