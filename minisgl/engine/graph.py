"""CUDA graphs for decode: capture once per padded batch size, replay for decode-only steps (one
launch instead of a few hundred small kernels).

Batches are padded to the next captured size; padding entries point at the dummy table row,
whose only slot is the pool's dummy page, so no request's KV is touched. Without capture (CPU)
the runner pads and runs eagerly over the same buffers: what CI checks. Mixed steps always run
eagerly (their shapes vary, and the prefill's matmuls dominate them)."""

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from minisgl.attention.base import AttentionBackend, AttentionBatch
from minisgl.attention.context import ForwardContext, forward_context
from minisgl.engine.batch import ForwardBatch
from minisgl.engine.tables import DeviceTables
from minisgl.kvcache.pool import KVPool

logger = logging.getLogger(__name__)

# Padded sizes: every small size, then steps that waste at most ~1/8 of a batch.
_SIZES_BELOW_128 = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112)
_STEP_FROM_128 = 32


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [*_SIZES_BELOW_128, *range(128, max_batch_size, _STEP_FROM_128)]
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


ModelFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class GraphRunner:
    model: ModelFn
    backend: AttentionBackend
    pool: KVPool
    tables: DeviceTables
    max_batch_size: int

    def __post_init__(self) -> None:
        self.stream = self.tables.stream
        self.sizes = graph_batch_sizes(self.max_batch_size)
        # Static inputs: every replay reads these addresses. [max batch] each
        self.table_rows, self.positions, self.kv_lens, self.out_slots = torch.zeros(
            (4, self.max_batch_size), dtype=torch.int64, device=self.stream.device
        )
        self.logit_index = torch.arange(self.max_batch_size, device=self.stream.device)
        self._graphs: dict[int, tuple[Any, Tensor]] = {}  # size -> (graph, logits)
        if self.backend.supports_graphs:
            self.backend.init_graph_state(self.max_batch_size)

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.num_seqs <= self.max_batch_size

    def run(self, batch: ForwardBatch) -> Tensor:
        """Logits [num_seqs, vocab] of a decode-only batch (replayed, or padded and eager)."""
        num_seqs, backend = batch.num_seqs, self.backend
        size = self.padded_size(num_seqs)
        attn = self._fill(size, batch.table_rows, batch.prefix_lens)
        if not backend.supports_graphs:
            return self._forward(size, backend.prepare(attn))[:num_seqs]
        metadata = backend.prepare_graph(attn, capturing=False)
        if size not in self._graphs:  # not captured (CPU): the same buffers, eagerly
            return self._forward(size, metadata)[:num_seqs]
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:num_seqs]

    def _fill(self, size: int, rows: list[int], positions: list[int]) -> AttentionBatch:
        """Write one step's rows and positions into the static buffers, padded to `size` with
        the dummy row at position 0 (all device values of the returned batch are this step's
        when the backend prepares)."""
        pad = size - len(rows)
        rows, positions = rows + [self.tables.dummy_row] * pad, positions + [0] * pad
        kv_lens = [p + 1 for p in positions]
        rows_d, pos_d, kv_d = self.stream.stage(torch.int64, rows, positions, kv_lens)
        table_rows, pos = self.table_rows[:size].copy_(rows_d), self.positions[:size].copy_(pos_d)
        self.kv_lens[:size].copy_(kv_d)
        self.out_slots[:size].copy_(self.tables.page_table[table_rows, pos])
        return AttentionBatch(
            table_rows=table_rows,
            prefix_lens=pos,
            kv_lens=self.kv_lens[:size],
            out_slots=self.out_slots[:size],
            page_table=self.tables.page_table,
            prefix_lens_cpu=positions,
            kv_lens_cpu=kv_lens,
        )

    def _forward(self, size: int, metadata: Any) -> Tensor:
        table_rows, pos = self.table_rows[:size], self.positions[:size]
        input_ids = self.tables.token_table[table_rows, pos].long()
        with forward_context(ForwardContext(self.backend, self.pool, metadata)):
            return self.model(input_ids, pos, self.logit_index[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per padded size, largest first (smaller ones reuse its memory)."""
        assert self.stream.is_cuda and self.backend.supports_graphs
        start_s = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.stream.device)
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            with self.stream.active():
                attn = self._fill(size, [], [])
                metadata = self.backend.prepare_graph(attn, capturing=True)
                self._forward(size, metadata)  # warm-up: lazy inits and autotuning run here
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=self.stream.cuda_stream):
                logits = self._forward(size, metadata)
            self._graphs[size] = (graph, logits)
        self.stream.synchronize()
        free_after, _ = torch.cuda.mem_get_info(self.stream.device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1f s using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start_s,
            (free_before - free_after) / (1 << 30),
        )
