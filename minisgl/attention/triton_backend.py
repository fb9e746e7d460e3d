"""Attention with our own Triton kernels (kernels/triton_attention.py): any CUDA GPU, and Triton's
interpreter on CPU (TRITON_INTERPRET=1, slow: how CI checks them). This is the host side: tile
sizes, launch grids, scratch and the extend kernel's query-block map.

Decodes run the split-KV decode kernel, whose launches depend only on the batch size (so CUDA
graphs capture them); prefill chunks run the extend kernel, which reads every query's K/V,
cached prefix and new tokens alike, through the page table."""

import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig, stage
from minisgl.kernels import triton_attention as kernels
from minisgl.kvcache.pool import KVPool

LOG2_E = math.log2(math.e)
# tl.dot wants each dimension of a tile to be >= 16 for tensor cores: GQA head groups (2 to 8
# query heads per KV head in common models) are padded up to this many rows.
MIN_DOT_ROWS = 16
MAX_HEAD_DIM = 256

# Decode (flash-decoding): one program per (sequence, KV head, KV split). BLOCK_N keys per step.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
# Decode splits each sequence's keys into up to this many parts (a power of two), computed by
# separate programs and merged by a small reduce kernel: enough parallelism at batch size 1.
MAX_DECODE_SPLITS = 16
# Splits are chosen so that a decode launch has about this many programs per SM: with fewer, a
# small batch leaves the GPU idle; with more, the extra programs only add reduce work.
DECODE_PROGRAMS_PER_SM = 4
# The interpreter has no SMs; this stands in for the count. Small, since each program is slow
# there, but enough that small CPU batches (tests) still run several splits through the reduce.
INTERPRETER_NUM_SMS = 4
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


def extend_block_map(extend_lens: list[int], block_m: int) -> Tensor:
    """Host-side map of query blocks, int32 [seqs + 2 * blocks]: each sequence's first query
    token, then each block's sequence, then each block's first query within its sequence."""
    q_lens = torch.tensor(extend_lens, dtype=torch.int64)
    num_blocks = (q_lens + block_m - 1) // block_m
    block_seq = torch.repeat_interleave(num_blocks)
    first_block = torch.cumsum(num_blocks, 0) - num_blocks
    block_q_start = (torch.arange(block_seq.numel()) - first_block[block_seq]) * block_m
    seq_q_start = torch.cumsum(q_lens, 0) - q_lens
    return torch.cat([seq_q_start, block_seq, block_q_start]).to(torch.int32)


@dataclass
class TritonDecodeMetadata:
    """Sequences of one query each. Only references the batch's tensors: for CUDA graphs those
    are the engine's static buffers, so replays see the lengths the engine wrote there."""

    table_rows: Tensor
    kv_lens: Tensor
    out_slots: Tensor
    page_table: Tensor
    part_out: Tensor  # fp32 [>= seqs, heads, MAX_DECODE_SPLITS, head_dim]
    part_lse: Tensor  # fp32 [>= seqs, heads, MAX_DECODE_SPLITS]
    num_splits: int  # a function of the batch shape only: a captured grid fits every replay


@dataclass
class TritonExtendMetadata:
    """A batch with prefill chunks. Its leading one-query sequences (the decodes, which the
    scheduler puts first) go to the decode kernel (`decodes`); the extend kernel, which tiles
    queries 64-128 rows at a time, takes the rest (the tensors below, from the first
    non-decode sequence on). `out_slots` covers every token: the store is one."""

    table_rows: Tensor
    prefix_lens: Tensor
    kv_lens: Tensor
    out_slots: Tensor
    page_table: Tensor
    block_map: Tensor  # extend_block_map(extend lens, BLOCK_M), on the device
    decodes: TritonDecodeMetadata | None


def decode_attention(
    q: Tensor,  # [seqs, heads, head_dim], one query per sequence
    k_cache: Tensor,  # [slots, kv_heads, head_dim]
    v_cache: Tensor,
    out: Tensor,  # [seqs, heads, head_dim]
    meta: TritonDecodeMetadata,
    scale: float,
) -> None:
    """Paged decode attention. The launch grid depends only on (seqs, kv_heads, num_splits) and
    every length is read on the device, so the launches can be captured in a CUDA graph."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    part_out, part_lse, num_splits = meta.part_out, meta.part_lse, meta.num_splits
    max_splits = part_lse.shape[2]
    assert 1 <= num_splits <= max_splits and part_out.stride(3) == part_lse.stride(2) == 1
    assert part_out.shape[0] >= num_seqs and part_lse.shape[0] >= num_seqs
    group = num_heads // num_kv_heads
    dim_block = block_d(head_dim)
    kernels.decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        meta.page_table,
        meta.table_rows,
        meta.kv_lens,
        part_out,
        part_lse,
        scale * LOG2_E,
        num_splits,
        *q.stride()[:2],
        *k_cache.stride()[:2],  # v_cache's too
        meta.page_table.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
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
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        BLOCK_D=dim_block,
        MAX_SPLITS=triton.next_power_of_2(max_splits),
    )


def extend_attention(
    q: Tensor,  # [tokens, heads, head_dim]
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,  # [tokens, heads, head_dim]
    meta: TritonExtendMetadata,
    scale: float,
) -> None:
    """Causal attention of each sequence's new queries over its whole paged K/V (cached prefix
    and this batch's tokens, already stored)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = meta.table_rows.numel()
    num_kv_heads = k_cache.shape[1]
    num_blocks = (meta.block_map.numel() - num_seqs) // 2
    if num_blocks == 0:
        return
    kernels.extend_kernel[(num_blocks, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        meta.page_table,
        meta.table_rows,
        meta.prefix_lens,
        meta.kv_lens,
        *meta.block_map.split([num_seqs, num_blocks, num_blocks]),
        scale * LOG2_E,
        *q.stride()[:2],
        *k_cache.stride()[:2],  # v_cache's too
        *out.stride()[:2],
        meta.page_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=extend_block_m(head_dim),
        BLOCK_N=EXTEND_BLOCK_N,
        BLOCK_D=block_d(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=EXTEND_NUM_WARPS,
        num_stages=EXTEND_NUM_STAGES,
    )


class TritonBackend(AttentionBackend):
    supports_graphs = True

    def __init__(self, cfg: AttentionConfig) -> None:
        if cfg.device.type != "cuda" and not kernels.INTERPRETER:
            raise ValueError(
                "attention_backend 'triton' runs on CUDA; on CPU only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before start-up; slow, meant for tests)"
            )
        e4m3_on_cuda = cfg.kv_dtype == torch.float8_e4m3fn and cfg.device.type == "cuda"
        if e4m3_on_cuda and torch.cuda.get_device_capability(cfg.device) < (8, 9):  # Triton's
            raise ValueError(
                "--kv-cache-dtype fp8_e4m3 with --attention-backend triton needs compute "
                "capability 8.9+ (Ada, Hopper): use fp8_e5m2, or flashinfer"
            )
        self.cfg = cfg
        num_sms = (
            torch.cuda.get_device_properties(cfg.device).multi_processor_count
            if cfg.device.type == "cuda"
            else INTERPRETER_NUM_SMS
        )
        self._target_programs = DECODE_PROGRAMS_PER_SM * num_sms
        # Scratch of the split decode kernel: eager batches grow theirs; captured graphs read
        # the graph scratch (init_graph_state), which is never replaced.
        self._eager_scratch = self._scratch(0)
        self._graph_scratch: tuple[Tensor, Tensor] | None = None

    def _scratch(self, num_seqs: int) -> tuple[Tensor, Tensor]:
        """fp32 partial outputs and log-sum-exps of the split decode kernel."""
        shape = (num_seqs, self.cfg.num_qo_heads, MAX_DECODE_SPLITS)
        return (
            torch.empty((*shape, self.cfg.head_dim), dtype=torch.float32, device=self.cfg.device),
            torch.empty(shape, dtype=torch.float32, device=self.cfg.device),
        )

    def _decodes(
        self, batch: AttentionBatch, num_seqs: int, scratch: tuple[Tensor, Tensor]
    ) -> TritonDecodeMetadata:
        """The first `num_seqs` sequences of `batch`, each one query, in KV splits picked from
        the batch size and the GPU's SM count."""
        wanted = triton.cdiv(self._target_programs, num_seqs * self.cfg.num_kv_heads)
        num_splits = min(MAX_DECODE_SPLITS, triton.next_power_of_2(wanted))
        return TritonDecodeMetadata(
            batch.table_rows[:num_seqs],
            batch.kv_lens[:num_seqs],
            batch.out_slots[:num_seqs],
            batch.page_table,
            *scratch,
            num_splits,
        )

    def prepare(self, batch: AttentionBatch) -> TritonDecodeMetadata | TritonExtendMetadata:
        extend_lens = batch.extend_lens_cpu
        # One query attending to its whole KV is a decode, whether it samples or ends a chunk.
        num_decodes = next((i for i, n in enumerate(extend_lens) if n != 1), len(extend_lens))
        if self._eager_scratch[0].shape[0] < num_decodes:
            self._eager_scratch = self._scratch(num_decodes)
        decodes = self._decodes(batch, num_decodes, self._eager_scratch) if num_decodes else None
        if decodes is not None and num_decodes == batch.num_seqs:
            return decodes
        block_map = extend_block_map(extend_lens[num_decodes:], extend_block_m(self.cfg.head_dim))
        return TritonExtendMetadata(
            table_rows=batch.table_rows[num_decodes:],
            prefix_lens=batch.prefix_lens[num_decodes:],
            kv_lens=batch.kv_lens[num_decodes:],
            out_slots=batch.out_slots,
            page_table=batch.page_table,
            block_map=stage(batch.table_rows.device, torch.int32, block_map)[0],
            decodes=decodes,
        )

    def init_graph_state(self, max_batch_size: int) -> None:
        if self._graph_scratch is None:
            self._graph_scratch = self._scratch(max_batch_size)

    def prepare_graph(self, batch: AttentionBatch, capturing: bool) -> TritonDecodeMetadata:
        # Capture and replay alike: nothing to refresh, since the kernels read the table rows and
        # KV lengths from the engine's static buffers and size their grid by the batch size.
        if not batch.is_decode:
            raise ValueError("CUDA graphs replay decode-only batches")
        scratch = self._graph_scratch
        if scratch is None or batch.num_seqs > scratch[0].shape[0]:
            raise ValueError(f"graph batch of {batch.num_seqs} exceeds init_graph_state")
        return self._decodes(batch, batch.num_seqs, scratch)

    def attend(
        self,
        q: Tensor,
        layer_id: int,
        pool: KVPool,
        metadata: TritonDecodeMetadata | TritonExtendMetadata,
    ) -> Tensor:
        k_cache, v_cache = pool.buffer[layer_id]
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = q.new_empty(q.shape)
        # What both kernels assume: whole GQA groups, and K, V, q, out and the page table's
        # rows in unit stride along their last dimension (the caches' strides alike).
        assert q.shape[1] % k_cache.shape[1] == 0 and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(2) == metadata.page_table.stride(1) == 1
        k_scale, v_scale = pool.layer_scales[layer_id]  # fp8's (else 1.0)
        scale = self.cfg.scale * k_scale
        if isinstance(metadata, TritonDecodeMetadata):
            decode_attention(q, k_cache, v_cache, out, metadata, scale)
        else:
            decodes, n = metadata.decodes, 0  # the decodes: one query each, q's first n rows
            if decodes is not None:
                n = decodes.table_rows.numel()
                decode_attention(q[:n], k_cache, v_cache, out[:n], decodes, scale)
            extend_attention(q[n:], k_cache, v_cache, out[n:], metadata, scale)
        return out if v_scale == 1.0 else out.mul_(v_scale)
