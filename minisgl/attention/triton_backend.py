"""Attention with our own Triton kernels: works on any CUDA GPU, and in Triton's interpreter on
CPU (TRITON_INTERPRET=1, slow: that is how CI checks the kernels).

Decode-only batches run the split-KV decode kernel, whose launches depend only on the batch size
and read every length from device tensors, so the engine can capture them in CUDA graphs. Any
other batch (prefill chunks, possibly with decodes mixed in) runs the extend kernel, which takes
every query's K/V, cached prefix and new tokens alike, from the pool through the page table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton

from minisgl.attention import triton_ops as ops
from minisgl.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionConfig,
    copy_to_device,
)
from minisgl.kvcache.pool import KVPool

# Decode splits each sequence's keys into up to this many parts (a power of two), computed by
# separate programs and merged by a small reduce kernel: enough parallelism at batch size 1.
MAX_DECODE_SPLITS = 16
# Splits are chosen so that a decode launch has about this many programs per SM: with fewer, a
# small batch leaves the GPU idle; with more, the extra programs only add reduce work.
DECODE_PROGRAMS_PER_SM = 4
# The interpreter has no SMs; this stands in for the count. Small, since each program is slow
# there, but enough that small CPU batches (tests) still run several splits through the reduce.
INTERPRETER_NUM_SMS = 4


@dataclass
class DecodeScratch:
    """fp32 partial results of the split decode kernel, for up to `out.shape[0]` sequences."""

    out: torch.Tensor  # [seqs, heads, MAX_DECODE_SPLITS, head_dim]
    lse: torch.Tensor  # [seqs, heads, MAX_DECODE_SPLITS]

    @classmethod
    def allocate(
        cls, num_seqs: int, num_heads: int, head_dim: int, device: torch.device
    ) -> DecodeScratch:
        out_shape, lse_shape = ops.decode_partial_shape(
            num_seqs, num_heads, MAX_DECODE_SPLITS, head_dim
        )
        return cls(
            torch.empty(out_shape, dtype=torch.float32, device=device),
            torch.empty(lse_shape, dtype=torch.float32, device=device),
        )

    def fits(self, num_seqs: int, q: torch.Tensor) -> bool:
        rows, heads, _, head_dim = self.out.shape
        return rows >= num_seqs and (heads, head_dim) == (q.shape[1], q.shape[2])


@dataclass
class TritonDecodeMetadata:
    """A decode-only batch. Only references the batch's tensors: for CUDA graphs those are the
    engine's static buffers, so replays see the lengths the engine wrote there."""

    num_seqs: int
    table_rows: torch.Tensor
    kv_lens: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    for_graph: bool

    @staticmethod
    def of(batch: AttentionBatch, num_seqs: int, for_graph: bool) -> TritonDecodeMetadata:
        """The first `num_seqs` sequences of `batch`, each one query."""
        return TritonDecodeMetadata(
            num_seqs,
            batch.table_rows[:num_seqs],
            batch.kv_lens[:num_seqs],
            batch.out_slots[:num_seqs],
            batch.page_table,
            for_graph,
        )


@dataclass
class TritonExtendMetadata:
    """A batch with prefill chunks. Its leading one-query sequences (the decodes, which the
    scheduler puts first) go to the decode kernel (`decodes`); the extend kernel, which tiles
    queries 64-128 rows at a time, takes the rest (`extend_lens` and the tensors below, from
    the first non-decode sequence on). `out_slots` covers every token: the store is one."""

    extend_lens: list[int]
    table_rows: torch.Tensor
    prefix_lens: torch.Tensor
    kv_lens: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    decodes: TritonDecodeMetadata | None = None
    # Query-block maps on the device by BLOCK_M, built at the first layer (the block size
    # depends on head_dim, which only forward sees) and reused by every other layer.
    block_maps: dict[int, torch.Tensor] = field(default_factory=dict)

    def block_map(self, block_m: int, device: torch.device) -> torch.Tensor:
        if block_m not in self.block_maps:
            host = ops.extend_block_map(self.extend_lens, block_m)
            self.block_maps[block_m] = copy_to_device(host, device)
        return self.block_maps[block_m]


class TritonBackend(AttentionBackend):
    supports_graphs: ClassVar[bool] = True

    def __init__(
        self, cfg: AttentionConfig | None = None, decode_splits: int | None = None
    ) -> None:
        """cfg: the model's attention shape (the engine always gives it; without it, scratch
        buffers are sized at the first forward). decode_splits: a fixed number of KV splits per
        decoded sequence (1 to MAX_DECODE_SPLITS); None picks it from the batch size and the
        GPU's SM count."""
        if decode_splits is not None and not 1 <= decode_splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"decode_splits must be in 1..{MAX_DECODE_SPLITS}")
        self.cfg = cfg
        self.decode_splits = decode_splits
        self._num_sms: int | None = None
        self._graph_max_seqs = 0
        # Captured graphs read the graph scratch: once allocated it is never replaced.
        self._graph_scratch: DecodeScratch | None = None
        self._eager_scratch: DecodeScratch | None = None

    # ---- metadata ---------------------------------------------------------------------------

    def prepare(self, batch: AttentionBatch) -> TritonDecodeMetadata | TritonExtendMetadata:
        if batch.is_decode:
            return TritonDecodeMetadata.of(batch, batch.num_seqs, for_graph=False)
        extend_lens = batch.extend_lens_cpu
        # One query attending to its whole KV is a decode, whether it samples or ends a chunk.
        num_decodes = next((i for i, n in enumerate(extend_lens) if n != 1), len(extend_lens))
        decodes = TritonDecodeMetadata.of(batch, num_decodes, False) if num_decodes else None
        return TritonExtendMetadata(
            extend_lens=extend_lens[num_decodes:],
            table_rows=batch.table_rows[num_decodes:],
            prefix_lens=batch.prefix_lens[num_decodes:],
            kv_lens=batch.kv_lens[num_decodes:],
            out_slots=batch.out_slots,
            page_table=batch.page_table,
            decodes=decodes,
        )

    def init_graph_state(self, max_batch_size: int) -> None:
        # Captured graphs read this scratch: allocated once, here (or, without a config, at the
        # first forward, which the engine runs eagerly before capturing), and never replaced.
        self._graph_max_seqs = max(self._graph_max_seqs, max_batch_size)
        if self.cfg is not None and self._graph_scratch is None:
            cfg = self.cfg
            self._graph_scratch = DecodeScratch.allocate(
                self._graph_max_seqs, cfg.num_qo_heads, cfg.head_dim, cfg.device
            )

    def prepare_graph(self, batch: AttentionBatch, capturing: bool) -> TritonDecodeMetadata:
        # Capture and replay alike: nothing to refresh, since the kernels read the table rows and
        # KV lengths from the engine's static buffers and size their grid by the batch size.
        if not batch.is_decode:
            raise ValueError("CUDA graphs replay decode-only batches")
        if batch.num_seqs > self._graph_max_seqs:
            raise ValueError(
                f"graph batch of {batch.num_seqs} exceeds init_graph_state({self._graph_max_seqs})"
            )
        return TritonDecodeMetadata.of(batch, batch.num_seqs, for_graph=True)

    # ---- forward ----------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scale: float,
        pool: KVPool,
        metadata: TritonDecodeMetadata | TritonExtendMetadata,
    ) -> torch.Tensor:
        pool.store(layer_id, metadata.out_slots, k, v)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if isinstance(metadata, TritonDecodeMetadata):
            self._decode(q, k_cache, v_cache, out, metadata, scale)
            return out
        num_decodes = 0
        if metadata.decodes is not None:
            num_decodes = metadata.decodes.num_seqs  # one query each: the first rows of q
            decode_q, decode_out = q[:num_decodes], out[:num_decodes]
            self._decode(decode_q, k_cache, v_cache, decode_out, metadata.decodes, scale)
        block_m = ops.extend_block_m(q.shape[2])
        ops.extend_attention(
            q[num_decodes:],
            k_cache,
            v_cache,
            out[num_decodes:],
            metadata.page_table,
            metadata.table_rows,
            metadata.prefix_lens,
            metadata.kv_lens,
            metadata.block_map(block_m, q.device),
            block_m,
            scale,
        )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: TritonDecodeMetadata,
        scale: float,
    ) -> None:
        scratch = self._decode_scratch(metadata, q)
        ops.decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            metadata.page_table,
            metadata.table_rows,
            metadata.kv_lens,
            scratch.out,
            scratch.lse,
            self._num_splits(metadata.num_seqs, k_cache.shape[1], q.device),
            scale,
        )

    def _decode_scratch(self, metadata: TritonDecodeMetadata, q: torch.Tensor) -> DecodeScratch:
        if metadata.for_graph:
            if self._graph_scratch is None:
                self._graph_scratch = DecodeScratch.allocate(
                    self._graph_max_seqs, q.shape[1], q.shape[2], q.device
                )
            if not self._graph_scratch.fits(metadata.num_seqs, q):
                raise ValueError("graph decode batch does not fit the scratch of init_graph_state")
            return self._graph_scratch
        if self._eager_scratch is None or not self._eager_scratch.fits(metadata.num_seqs, q):
            rows = metadata.num_seqs
            if self._eager_scratch is not None:
                rows = max(rows, self._eager_scratch.out.shape[0])
            self._eager_scratch = DecodeScratch.allocate(rows, q.shape[1], q.shape[2], q.device)
        return self._eager_scratch

    def _num_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """A function of the batch shape only (never of KV lengths), so a captured graph's grid
        stays valid for every replay."""
        if self.decode_splits is not None:
            return self.decode_splits
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else INTERPRETER_NUM_SMS
            )
        target = DECODE_PROGRAMS_PER_SM * self._num_sms
        wanted = triton.cdiv(target, num_seqs * num_kv_heads)
        return min(MAX_DECODE_SPLITS, triton.next_power_of_2(wanted))
