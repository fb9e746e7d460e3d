"""Host side of the Triton attention kernels: tile sizes, launch grids, scratch shapes and the
query-block map of the extend kernel. See `triton_kernels` for the device code.
"""

from __future__ import annotations

import math

import torch
import triton

from minisgl.attention import triton_kernels as kernels

LOG2_E = math.log2(math.e)
# tl.dot wants each dimension of a tile to be >= 16 for tensor cores: GQA head groups (2 to 8
# query heads per KV head in common models) are padded up to this many rows.
MIN_DOT_ROWS = 16
MAX_HEAD_DIM = 256

# Decode (flash-decoding): one program per (sequence, KV head, KV split). BLOCK_N keys per step.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
# Extend: one program per (query block, query head), BLOCK_M queries x BLOCK_N keys per step.
# Large head dims halve BLOCK_M to keep the fp32 accumulator in registers.
EXTEND_BLOCK_M = 128
EXTEND_BLOCK_M_LARGE_HEAD = 64
EXTEND_BLOCK_N = 64
EXTEND_NUM_WARPS = 8
EXTEND_NUM_STAGES = 2


def _dot_precision(dtype: torch.dtype) -> str:
    # TF32 would cost fp32 inputs ~3 decimal digits; 16-bit inputs are exact in any mode.
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{MAX_HEAD_DIM})")
    return max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))


def extend_block_m(head_dim: int) -> int:
    return EXTEND_BLOCK_M if head_dim <= 128 else EXTEND_BLOCK_M_LARGE_HEAD


def decode_partial_shape(
    num_seqs: int, num_heads: int, max_splits: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 scratch the decode kernel needs: (partial outputs, log-sum-exps)."""
    return (num_seqs, num_heads, max_splits, head_dim), (num_seqs, num_heads, max_splits)


def decode_attention(
    q: torch.Tensor,  # [seqs, heads, head_dim], one query per sequence
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [seqs, heads, head_dim]
    page_table: torch.Tensor,  # int32 [rows, max_len]
    table_rows: torch.Tensor,  # [seqs]
    kv_lens: torch.Tensor,  # [seqs]
    part_out: torch.Tensor,  # fp32 [>= seqs, heads, max_splits, head_dim]
    part_lse: torch.Tensor,  # fp32 [>= seqs, heads, max_splits]
    num_splits: int,
    scale: float,
) -> None:
    """Paged decode attention. The launch grid depends only on (seqs, kv_heads, num_splits) and
    every length is read on the device, so the launches can be captured in a CUDA graph."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    max_splits = part_lse.shape[2]
    assert num_heads % num_kv_heads == 0 and 1 <= num_splits <= max_splits
    assert part_out.shape[0] >= num_seqs and part_lse.shape[0] >= num_seqs
    assert q.stride(2) == k_cache.stride(2) == v_cache.stride(2) == out.stride(2) == 1
    assert page_table.stride(1) == 1 and part_out.stride(3) == part_lse.stride(2) == 1
    group = num_heads // num_kv_heads
    dim_block = block_d(head_dim)
    kernels.decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        table_rows,
        kv_lens,
        part_out,
        part_lse,
        scale * LOG2_E,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=dim_block,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
    )
    kernels.decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=dim_block,
        MAX_SPLITS=triton.next_power_of_2(max_splits),
    )


def extend_block_map(extend_lens: list[int], block_m: int) -> torch.Tensor:
    """Host-side map of query blocks, int32 [seqs + 2 * blocks]: each sequence's first query
    token, then each block's sequence, then each block's first query within its sequence."""
    q_lens = torch.tensor(extend_lens, dtype=torch.int32)
    num_blocks = (q_lens + block_m - 1) // block_m
    seq_q_start = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    block_seq = torch.repeat_interleave(
        torch.arange(len(extend_lens), dtype=torch.int32), num_blocks
    )
    first_block = torch.cumsum(num_blocks, 0, dtype=torch.int32) - num_blocks
    block_index = torch.arange(block_seq.numel(), dtype=torch.int32)
    block_q_start = (block_index - first_block.repeat_interleave(num_blocks)) * block_m
    return torch.cat([seq_q_start, block_seq, block_q_start])


def extend_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [tokens, heads, head_dim]
    page_table: torch.Tensor,
    table_rows: torch.Tensor,  # [seqs]
    prefix_lens: torch.Tensor,  # [seqs]
    kv_lens: torch.Tensor,  # [seqs]
    block_map: torch.Tensor,  # extend_block_map(extend_lens, block_m), on the device
    block_m: int,
    scale: float,
) -> None:
    """Causal attention of each sequence's new queries over its whole paged K/V (cached prefix
    and this batch's tokens, already stored)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = table_rows.numel()
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0
    assert q.stride(2) == k_cache.stride(2) == v_cache.stride(2) == out.stride(2) == 1
    assert page_table.stride(1) == 1
    num_blocks = (block_map.numel() - num_seqs) // 2
    if num_blocks == 0:
        return
    seq_q_start = block_map[:num_seqs]
    block_seq = block_map[num_seqs : num_seqs + num_blocks]
    block_q_start = block_map[num_seqs + num_blocks :]
    kernels.extend_kernel[(num_blocks, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        table_rows,
        prefix_lens,
        kv_lens,
        seq_q_start,
        block_seq,
        block_q_start,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=EXTEND_BLOCK_N,
        BLOCK_D=block_d(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=EXTEND_NUM_WARPS,
        num_stages=EXTEND_NUM_STAGES,
    )
