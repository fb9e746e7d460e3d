"""FlashInfer attention on CUDA: paged prefill (with cached prefixes) and paged decode.

A layer's pool buffer is viewed as FlashInfer's NHD pages; new K/V are stored first, so every
sequence attends to pages only. One `plan` per forward serves every layer: the decode wrapper
for decode-only batches (tensor cores for large GQA groups, as SGLang decides), else the prefill
wrapper for all (decodes as one-query prefills). CUDA graphs: one decode wrapper per captured
size, over fixed index buffers that `prepare_graph` re-plans before every replay."""

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from minisgl.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionConfig,
    host_tensor,
    stage,
)
from minisgl.kvcache.pool import KVPool

# FlashInfer's recommended float workspace (split-KV partial results), allocated once.
WORKSPACE_BYTES = 256 << 20
# Tensor-core decode pays off once a KV head serves this many query heads.
TENSOR_CORE_MIN_GQA = 4
# FA2 kernels for prefill: FA3 (Hopper) JIT-compiles far longer for a small gain on chunks.
PREFILL_KERNEL_BACKEND = "fa2"


def paged_kv_lists(batch: AttentionBatch, page_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashInfer's paged-KV description of a batch: (indptr int32 on the host, page ids int32 on
    the device, last page lengths int32 on the host) and the KV lengths (int32, on the host) that
    plan() would otherwise recompute from the first and last. Host tensors are pinned on CUDA."""
    device = batch.table_rows.device
    kv_lens = host_tensor(batch.kv_lens_cpu, torch.int32)
    num_pages = (kv_lens + page_size - 1) // page_size
    indptr = F.pad(torch.cumsum(num_pages, 0, dtype=torch.int32), (1, 0))
    last_page_len = (kv_lens - 1) % page_size + 1
    # Page k of sequence i is the page holding position k * page_size of its table row: the
    # (sequence, position) pairs are built on the host, the gather from the table on the device,
    # so nothing waits for the host.
    seq = torch.repeat_interleave(num_pages.long())
    first_pos = (torch.arange(seq.numel()) - indptr[seq]) * page_size
    seq_d, pos_d = stage(device, torch.int64, seq, first_pos)
    page_ids = (batch.page_table[batch.table_rows[seq_d], pos_d] // page_size).to(torch.int32)
    if device.type == "cuda":
        indptr, last_page_len = indptr.pin_memory(), last_page_len.pin_memory()
    return indptr, page_ids, last_page_len, kv_lens


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned prefill or decode wrapper
    out_slots: Tensor


class FlashInferBackend(AttentionBackend):
    supports_graphs = True

    def __init__(self, cfg: AttentionConfig) -> None:
        import flashinfer  # lazily: an optional CUDA-only package

        if cfg.device.type != "cuda":
            raise ValueError("attention_backend flashinfer needs a CUDA device")
        if cfg.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"attention_backend flashinfer supports float16 and bfloat16, not {cfg.dtype} "
                "(use --dtype bfloat16, or --attention-backend triton/torch for float32)"
            )
        self.cfg = cfg
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cfg.device)
        # A decode wrapper (eager, or one per captured size with its buffers given)
        self._decode_wrapper = partial(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper,
            self.workspace,
            "NHD",
            use_tensor_cores=cfg.num_qo_heads // cfg.num_kv_heads >= TENSOR_CORE_MIN_GQA,
        )
        self.decode_wrapper = self._decode_wrapper()
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=PREFILL_KERNEL_BACKEND
        )
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_indices: Tensor | None = None
        # plan() writes its metadata into a pinned host buffer of the wrapper and queues an
        # async copy from it; under overlap the next plan() can come before that copy ran (the
        # batch in flight is queued ahead of it) and would overwrite what it copies. Each plan
        # therefore waits for the previous plan's copy: by then only the in-flight batch's
        # start, so the wait is short (Mini-SGLang hit and fixed the same race).
        self._planned = torch.cuda.Event()
        self._planned.record()

    # ---- metadata --------------------------------------------------------------------------

    def _plan(
        self, wrapper: Any, batch: AttentionBatch, *qo_indptr: Tensor, **kw: Any
    ) -> FlashInferMetadata:
        """`wrapper.plan(...)` for `batch` (a prefill wrapper's `qo_indptr` first), after the
        previous plan's host-to-device copy has run."""
        cfg = self.cfg
        # (indptr, page ids, last page lengths)
        *kv_lists, kv_lens = paged_kv_lists(batch, cfg.page_size)
        heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size)
        self._planned.synchronize()
        wrapper.plan(
            *qo_indptr,
            *kv_lists,
            *heads,
            seq_lens=kv_lens,
            q_data_type=cfg.dtype,
            kv_data_type=cfg.kv_dtype or cfg.dtype,
            sm_scale=cfg.scale,
            **kw,
        )
        self._planned.record()
        return FlashInferMetadata(wrapper, batch.out_slots)

    def prepare(self, batch: AttentionBatch) -> FlashInferMetadata:
        if batch.is_decode:
            return self._plan(self.decode_wrapper, batch)
        # Every sequence through the prefill wrapper, decodes as one-query prefills.
        extend_lens = host_tensor(batch.extend_lens_cpu, torch.int32)
        qo_indptr = F.pad(torch.cumsum(extend_lens, 0, dtype=torch.int32), (1, 0))
        return self._plan(self.prefill_wrapper, batch, qo_indptr.pin_memory(), causal=True)

    # ---- the forward -----------------------------------------------------------------------

    def attend(
        self, q: Tensor, layer_id: int, pool: KVPool, metadata: FlashInferMetadata
    ) -> Tensor:
        # [2, slots, kv_heads, head_dim] -> K and V, each [pages, page_size, kv_heads, head_dim]
        kv_pages = tuple(pool.buffer[layer_id].unflatten(1, (-1, pool.page_size)))
        k_scale, v_scale = pool.layer_scales[layer_id]  # fp8's (else 1.0)
        return metadata.wrapper.run(q.contiguous(), kv_pages, k_scale=k_scale, v_scale=v_scale)

    # ---- CUDA graphs -----------------------------------------------------------------------

    def init_graph_state(self, max_batch_size: int) -> None:
        cfg = self.cfg
        max_pages = max_batch_size * (-(-cfg.max_seq_len // cfg.page_size))
        self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=cfg.device)
        self._graph_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=cfg.device)
        self._graph_last = torch.zeros(max_batch_size, dtype=torch.int32, device=cfg.device)

    def prepare_graph(self, batch: AttentionBatch, capturing: bool) -> FlashInferMetadata:
        size = batch.num_seqs
        if (wrapper := self._graph_wrappers.get(size)) is None:
            assert capturing and self._graph_indices is not None
            wrapper = self._decode_wrapper(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self._graph_indptr[: size + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last[:size],
            )
            self._graph_wrappers[size] = wrapper
        # In graph mode plan() copies into the fixed buffers the captured kernels read.
        return self._plan(wrapper, batch)
