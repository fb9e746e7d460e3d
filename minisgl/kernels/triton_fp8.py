"""FP8 linear layers: an FP8 checkpoint's weights multiplied as fp8 on the tensor cores.

The weight stays as shipped (`Fp8Tensor`: a scale per row and column group). Activations are
quantized per token and group inside the GEMM (block-wise w8a8, as SGLang and vLLM serve it):
each K step scales an x tile's rows onto the fp8 range, multiplies, and rescales the fp32
product by both scales (docs/models.md, "Quantization"). Tile sizes are not tuned on a GPU yet.
Loaded where FP8 tensor cores exist (8.9+); tests run it under TRITON_INTERPRET=1."""

import triton
import triton.language as tl
from torch import Tensor

from minisgl.kernels.triton_fused import unit_stride_rows
from minisgl.kernels.weights import Fp8Tensor


@triton.jit
def quantize_rows(x, dtype: tl.constexpr):
    """x [rows, cols] as fp8 `dtype` codes and one fp32 scale per row: x ~ codes * scale. The
    row's absolute max maps exactly onto the format's largest value, so nothing saturates (an
    all-zero row keeps a tiny scale: its products are zero whatever the scale)."""
    if dtype == tl.float8e4nv:  # e4m3: 3 of fp32's 23 mantissa bits kept
        fp8_max = 448.0
        drop = 20
    else:  # e5m2
        fp8_max = 57344.0
        drop = 21
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / fp8_max
    # Rounded to the fp8 mantissa by hand (to nearest, ties to even) so the conversion is
    # exact: Triton's interpreter, where the tests run, drops the carry of a mantissa that
    # rounds up into the next power of two (124.3 -> 64, not 128).
    bits = (x / scale[:, None]).to(tl.uint32, bitcast=True)
    bits = (bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) >> drop << drop
    return bits.to(tl.float32, bitcast=True).to(dtype), scale


@triton.jit
def _fp8_linear(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    s_stride,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k = g * GROUP + tl.arange(0, GROUP)
        x_mask = (rows[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=x_mask, other=0.0)
        x_q, x_scale = quantize_rows(x, w_ptr.dtype.element_ty)
        w_mask = (cols[None, :] < N) & (k[:, None] < K)
        w = tl.load(w_ptr + cols[None, :] * w_stride + k[:, None], mask=w_mask, other=0.0)
        w_scale = tl.load(s_ptr + cols * s_stride + g, mask=cols < N, other=0.0)
        acc += tl.dot(x_q, w) * x_scale[:, None] * w_scale[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + rows[:, None] * y_stride + cols[None, :],
        y,
        (rows[:, None] < M) & (cols[None, :] < N),
    )


def fp8_linear(x: Tensor, w: Fp8Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., in] (any float dtype) times `w` [out, in] transposed, plus bias: [..., out] in
    x's dtype."""
    rows = unit_stride_rows(x)
    (m, k), n = rows.shape, w.data.shape[0]
    y = x.new_empty(m, n)
    if m:  # tl.dot needs 16+ rows a tile; decode batches take the smallest
        block_m = 16 if m <= 16 else 32 if m <= 64 else 64
        block_n = 64 if m <= 64 else 128
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _fp8_linear[grid](
            rows,
            w.data,
            w.scale,
            y,
            m,
            n,
            k,
            rows.stride(0),
            w.data.stride(0),
            w.scale.stride(0),
            y.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            GROUP=w.group,
            num_warps=4,
            num_stages=3,
        )
    y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias
