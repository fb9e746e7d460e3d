"""Fused MoE in Triton: routed (token, slot) pairs sorted by expert, then two grouped GEMMs.

`align_pairs_by_expert` pads each expert's run to a multiple of BLOCK_M with static shapes and
no host sync (so CUDA graphs capture the layer); the gate/up pass accumulates both halves in one
sweep and applies SiLU-and-mul in its epilogue; the down pass scales by the routing weight; the
token's top_k rows are summed in torch. Importing it imports triton (callers import it lazily);
under TRITON_INTERPRET=1 the tests check it against `moe_torch` on CPU tensors."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from minisgl.kernels.triton_fp8 import quantize_rows
from minisgl.kernels.weights import FP8_GROUP

# tl.dot needs every block dim >= 16. Small batches (decode) put few rows on each expert: a
# 16-row block wastes less padding; large batches amortise weight loads over 64 rows.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
ROWS_PER_EXPERT_FOR_LARGE_BLOCK = 32
BLOCK_N = 64
BLOCK_K = 64
BLOCK_K_FP32 = 32  # fp32 tiles take twice the registers / shared memory
NUM_WARPS = 4
NUM_STAGES = 3


def align_pairs_by_expert(
    topk_ids: Tensor, num_experts: int, block_m: int
) -> tuple[Tensor, Tensor]:
    """Sort routed pairs by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted_pair_ids [padded_len] int32, block_experts [padded_len // block_m] int32):
    sorted_pair_ids holds pair indices (token * top_k + slot) in expert order, padding slots hold
    num_pairs (the kernels skip them); block_experts[b] is the expert of rows
    [b * block_m, (b + 1) * block_m), or num_experts for blocks past the last expert's run.
    """
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    run_start = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank_in_run = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    # Each expert that receives a pair adds at most block_m - 1 padding rows.
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    padded_len = triton.cdiv(bound, block_m) * block_m
    sorted_pair_ids = torch.full((padded_len,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_start[sorted_experts] + rank_in_run] = order.to(torch.int32)
    block_starts = torch.arange(0, padded_len, block_m, device=device)
    # Experts with padded_end <= start have all finished: their count is this block's expert.
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pair_ids, block_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # gate/up: x [tokens, K]; down: h [pairs, K]
    w_ptr,  # gate/up: [experts, 2 * N, K]; down: [experts, N, K]
    out_ptr,  # [pairs, N]
    scale_ptr,  # FP8: w's scales [experts, rows of w, K / BLOCK_K] (else unused)
    pair_weights_ptr,  # [pairs] fp32 routing weights (down pass only)
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    num_experts,
    top_k,
    # N and K are fixed per model, so compile-time constants cost no extra compiles.
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    GATE_UP: tl.constexpr,
    FP8: tl.constexpr,  # w fp8 with a scale per row and BLOCK_K columns; x quantized to match
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 parity, else "tf32" (ignored for bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert == num_experts:  # past the last expert's run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    row_ok = pairs < num_pairs  # padding rows hold num_pairs
    if GATE_UP:  # noqa: SIM108 (a compile-time branch: Triton's documented form)
        a_rows = pairs // top_k  # x rows are tokens
    else:
        a_rows = pairs  # h rows are pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    # B tile [BLOCK_K, BLOCK_N] = W[expert, n, k] transposed
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_ptrs = scale_ptr + expert * stride_se + offs_n * stride_sn
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FP8:  # as minisgl/kernels/triton_fp8.py: the gate and up products share a's codes
            a, a_scale = quantize_rows(a, w.dtype)
            s = tl.load(s_ptrs + k0 // BLOCK_K, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * s[None, :]
        else:
            acc += tl.dot(a, w, input_precision=INPUT_PRECISION)
        if GATE_UP:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            if FP8:
                s = tl.load(s_ptrs + N * stride_sn + k0 // BLOCK_K, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, w_up) * a_scale[:, None] * s[None, :]
            else:
                acc_up += tl.dot(a, w_up, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATE_UP:
        result = acc * tl.sigmoid(acc) * acc_up
    else:
        result = acc * tl.load(pair_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_moe(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Same contract as `moe_torch`: x [tokens, hidden]; gate_up [experts, 2 * inter, hidden];
    down [experts, hidden, inter]; topk_weights / topk_ids [tokens, top_k]. With `scales`
    (gate_up's and down's, [experts, rows, ceil(cols / FP8_GROUP)]) the weights are fp8 (an FP8
    checkpoint's), multiplied as minisgl/kernels/triton_fp8.py multiplies a linear layer's."""
    num_tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    rows_per_expert = num_pairs / num_experts
    block_m = LARGE_BLOCK_M if rows_per_expert >= ROWS_PER_EXPERT_FOR_LARGE_BLOCK else SMALL_BLOCK_M
    sorted_pair_ids, block_experts = align_pairs_by_expert(topk_ids, num_experts, block_m)
    pair_weights = topk_weights.flatten().to(torch.float32).contiguous()

    def grouped_gemm(a: Tensor, w: Tensor, n: int, is_gate_up: bool) -> Tensor:
        """One pass of the kernel over the sorted pairs: [pairs, n]."""
        out = x.new_empty(num_pairs, n)
        assert a.stride(1) == 1 and w.stride(2) == 1, "the kernel assumes a unit stride along K"
        # FP8: one tile of K per scale
        block_k = FP8_GROUP if scales else BLOCK_K_FP32 if a.dtype == torch.float32 else BLOCK_K
        scale = pair_weights if scales is None else scales[0 if is_gate_up else 1]
        grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
        _grouped_gemm_kernel[grid](
            a,
            w,
            out,
            scale,
            pair_weights,
            sorted_pair_ids,
            block_experts,
            num_pairs,
            num_experts,
            top_k,
            n,
            a.shape[1],
            a.stride(0),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            scale.stride(0),
            scale.stride(1) if scales else 0,
            GATE_UP=is_gate_up,
            FP8=bool(scales),
            INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=block_k,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
        return out

    h = grouped_gemm(x, gate_up, inter, is_gate_up=True)  # silu(x W_gate^T) * (x W_up^T)
    y = grouped_gemm(h, down, hidden, is_gate_up=False)  # w[p] * (h W_down^T)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
