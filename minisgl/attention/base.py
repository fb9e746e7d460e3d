"""The attention-backend contract: torch-native (CPU, CUDA fallback), Triton and FlashInfer."""

import array
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from minisgl.kvcache.pool import KVPool


@dataclass(frozen=True)
class AttentionConfig:
    """What a backend may size itself by, fixed at start-up (head counts are this rank's)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_seq_len: int  # width of the page table: no sequence is longer
    dtype: torch.dtype  # of queries (and of the KV pool unless kv_dtype says otherwise)
    device: torch.device
    kv_dtype: torch.dtype | None = None  # --kv-cache-dtype: what the pool stores

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)


@dataclass(frozen=True)
class AttentionBatch:
    """Shape of one forward, per sequence, as the backend needs it (tensors on the device).

    For sequence i: queries are the tokens at positions [prefix_lens[i], kv_lens[i]); its
    keys/values are positions [0, kv_lens[i]), found in the pool through
    `page_table[table_rows[i], :kv_lens[i]]` (token slots). Queries are laid out back to back in
    sequence order; `out_slots` ([tokens]) are where this batch's new K/V go.
    """

    table_rows: Tensor  # int64 [seqs]
    prefix_lens: Tensor  # int64 [seqs]
    kv_lens: Tensor  # int64 [seqs]
    out_slots: Tensor  # int64 [tokens]
    page_table: Tensor  # int32 [max_rows, max_len], token slots
    prefix_lens_cpu: list[int]
    kv_lens_cpu: list[int]

    @property
    def extend_lens_cpu(self) -> list[int]:
        return [kv - pre for kv, pre in zip(self.kv_lens_cpu, self.prefix_lens_cpu, strict=True)]

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one query (the batches CUDA graphs replay)."""
        return all(e == 1 for e in self.extend_lens_cpu)


# array.array type codes of the dtypes the host builds index and parameter tensors in.
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: Sequence[Any] | Tensor, dtype: torch.dtype) -> Tensor:
    """A 1-D host tensor of `values` as `dtype`. From a list of Python numbers it goes through
    `array.array` and `torch.frombuffer` (no copy), well ahead of `torch.tensor`'s per-element
    cost, paid several times a step for every running request (RESULTS.md section 15)."""
    code = _ARRAY_CODES.get(dtype)
    if isinstance(values, Tensor) or code is None or not len(values):
        return torch.as_tensor(values, dtype=dtype)
    try:
        return torch.frombuffer(array.array(code, values), dtype=dtype)
    except TypeError:  # not plain ints / floats (numpy scalars, ...): torch converts them
        return torch.as_tensor(values, dtype=dtype)


def stage(
    device: torch.device, dtype: torch.dtype, *values: Sequence[Any] | Tensor
) -> list[Tensor]:
    """1-D host values (lists or tensors) on `device` as `dtype`, queued without making the host
    wait. On CUDA they go in one non-blocking copy through pinned memory: a copy from pageable
    memory is staged synchronously, and under overlap that can hold the host until the batch in
    flight finishes; `torch.tensor(values, device="cuda")` even waits for the whole stream."""
    host = [host_tensor(v, dtype) for v in values]
    if device.type != "cuda":
        return [t.to(device) for t in host]
    on_device = torch.cat(host).pin_memory().to(device, non_blocking=True)
    return list(on_device.split([t.numel() for t in host]))


class AttentionBackend(ABC):
    """Computes attention for a mixed batch (prefill chunks with cached prefixes, and decodes)
    directly from the paged KV pool. `prepare` runs once per forward and returns metadata every
    layer reuses; `forward` stores the layer's new K/V at `batch.out_slots`, then its `attend`
    returns the output [tokens, heads, head_dim] (softmax scale: the config's). A backend with
    `supports_graphs` also serves CUDA graphs (docs/architecture.md, "CUDA graphs"):
    `prepare_graph` over the engine's static buffers refreshes in place whatever the captured
    kernels read, and never allocates what they read."""

    supports_graphs: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any: ...

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, pool: KVPool, metadata: Any
    ) -> Tensor:
        """Store the layer's new K/V at the batch's `out_slots` (every backend's metadata has
        them), then attend to the pool."""
        pool.store(layer_id, metadata.out_slots, k, v)
        return self.attend(q, layer_id, pool, metadata)

    @abstractmethod
    def attend(self, q: Tensor, layer_id: int, pool: KVPool, metadata: Any) -> Tensor:
        """The attention output of queries q [tokens, heads, head_dim] over the pool, where
        this batch's K/V are stored already."""

    def init_graph_state(self, max_batch_size: int) -> None:
        """Allocate buffers that captured graphs read (for up to `max_batch_size` decodes); the
        engine calls it once, before any `prepare_graph`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_graph(self, batch: AttentionBatch, capturing: bool) -> Any:
        """Metadata for a decode-only batch over the engine's static buffers: for a capture
        (`capturing`), then before every replay with the same tensors. Padding sequences point at
        a dummy table row with KV length 1."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
