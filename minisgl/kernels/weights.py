"""How the kernels hold a linear weight: fp32 column panels or GGUF blocks (CPU), fp8 (GPU).

A `QuantTensor` is a checkpoint tensor as a GGUF file stores it (rows of llama.cpp blocks); an
`Fp8Tensor` an FP8 checkpoint's weight with a scale per row and column group. Both cut as
`torch.Tensor.narrow` does: rows exactly, columns exactly on block or group boundaries (a cut
inside one comes dequantized). `PackedLinear` is what the C kernels multiply by."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20  # x86-64 / arm64 transparent huge page size
MAX_SEGMENTS = 4  # MG_MAX_SEGMENTS in csrc/common.h: block types in one merged weight
F32 = 0  # gguf.GGMLQuantizationType.F32: plain fp32 rows
FP8_GROUP = 128  # columns per scale of a per-row or per-tensor FP8 weight (any width works)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zeroed CPU tensor in memory advised for transparent huge pages (Linux), else plain.

    Streaming the weights crosses a 4 KiB page every 1024 floats: with huge pages the TLB
    misses and the prefetchers' restarts mostly go away (RESULTS.md section 10). The memory is a
    private anonymous mapping: zero-filled, committed page by page as it is first written, and
    freed when the last tensor viewing it goes away (the tensor keeps the mapping alive)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or num_bytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(
        -1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES  # huge pages need 2 MiB-aligned addresses
    return raw[start : start + num_bytes].view(dtype).view(shape)


@dataclass(frozen=True)
class QuantTensor:
    qtype: int  # gguf.GGMLQuantizationType
    data: Tensor  # uint8 [rows, row bytes]
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    @staticmethod
    def of_float(t: Tensor) -> QuantTensor:
        return QuantTensor(F32, t.float().contiguous().view(torch.uint8), t.shape[1])

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        """Rows or columns, as `torch.Tensor.narrow`."""
        if dim % 2 == 0:
            return QuantTensor(self.qtype, self.data.narrow(0, start, length), self.cols)
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        if start % block or length % block:
            return QuantTensor.of_float(self.dequantize().narrow(1, start, length))
        cut = self.data.narrow(1, start // block * block_bytes, length // block * block_bytes)
        return QuantTensor(self.qtype, cut, length)

    def dequantize(self) -> Tensor:
        """fp32 [rows, cols], as gguf (and transformers' GGUF loader) dequantizes."""
        rows = np.ascontiguousarray(self.data.numpy())
        return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType(self.qtype))))


@dataclass(frozen=True)
class Fp8Tensor:
    data: Tensor  # float8 [rows, cols]
    scale: Tensor  # fp32 [rows, ceil(cols / group)]: w = data * scale, group by group
    group: int  # columns per scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @staticmethod
    def of_checkpoint(w: Tensor, scale: Tensor, block: Sequence[int]) -> Fp8Tensor:
        """`scale` as checkpoints store it: [ceil(rows / bn), ceil(cols / bk)] for (bn, bk)
        blocks (`weight_scale_inv`), [rows, 1] per row or one per tensor (`weight_scale`)."""
        (rows, cols), (bn, bk) = w.shape, block
        if scale.numel() > 1 and tuple(scale.shape) not in ((rows,), (rows, 1)):
            if scale.shape != (-(-rows // bn), -(-cols // bk)):
                raise ValueError(f"scale {tuple(scale.shape)}: not {bn}x{bk} blocks of {w.shape}")
            return Fp8Tensor(w, scale.float().repeat_interleave(bn, 0)[:rows].contiguous(), bk)
        by_row = scale.float().reshape(-1, 1).expand(rows, -(-cols // FP8_GROUP)).contiguous()
        return Fp8Tensor(w, by_row, FP8_GROUP)

    def narrow(self, dim: int, start: int, length: int) -> Fp8Tensor | Tensor:
        """Rows or columns, as `torch.Tensor.narrow`: columns exact on group boundaries, else
        this piece dequantized (fp32)."""
        if dim % 2 == 0:
            scale = self.scale.narrow(0, start, length)
            return Fp8Tensor(self.data.narrow(0, start, length), scale, self.group)
        if start % self.group or (length % self.group and start + length < self.data.shape[1]):
            return self.dequantize().narrow(1, start, length)
        scale = self.scale.narrow(1, start // self.group, -(-length // self.group))
        return Fp8Tensor(self.data.narrow(1, start, length), scale, self.group)

    def dequantize(self) -> Tensor:
        scale = self.scale.repeat_interleave(self.group, 1)[:, : self.data.shape[1]]
        return self.data.float() * scale

    @staticmethod
    def cat(parts: Sequence[Fp8Tensor], device: torch.device) -> Fp8Tensor:
        """A merged weight's parts (as loaded: on the CPU), stacked by rows on `device`."""
        data, scale = (torch.cat([getattr(p, n) for p in parts]) for n in ("data", "scale"))
        return Fp8Tensor(data.to(device), scale.to(device), parts[0].group)


# A checkpoint tensor as the loader hands it to a layer: plain, GGUF blocks or fp8.
Weight = Tensor | QuantTensor | Fp8Tensor


def dense(t: Weight) -> Tensor:
    """A checkpoint tensor as a plain one (blocks and fp8 dequantized)."""
    return t if isinstance(t, Tensor) else t.dequantize()


class WeightDesc(ctypes.Structure):
    """`mg_weight` (csrc/common.h): fp32 panels (no segments), or runs of GGUF block rows."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("num_segments", ctypes.c_int64),
        *[(name, ctypes.c_int64 * MAX_SEGMENTS) for name in ("types", "rows")],
    ]


@dataclass(frozen=True)
class PackedLinear:
    """A linear weight [out, in] as column panels [ceil(out / block_n), in, block_n], the rows
    past `out_features` zero; or, with `segments` ((GGUF type, rows) each), GGUF block rows back
    to back (uint8). What `CpuKernels.linear` multiplies by, through `desc`."""

    panels: Tensor
    out_features: int
    in_features: int
    segments: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of_blocks(by_part: dict[int, QuantTensor]) -> PackedLinear:
        """The block rows of a merged weight's parts, in order, in one huge-page buffer."""
        parts = [by_part[i] for i in sorted(by_part)]
        assert len(parts) <= MAX_SEGMENTS and len({p.cols for p in parts}) == 1
        blocks = huge_page_zeros((sum(p.data.numel() for p in parts),), torch.uint8)
        torch.cat([p.data.reshape(-1) for p in parts], out=blocks)
        segments = tuple((p.qtype, p.shape[0]) for p in parts)
        return PackedLinear(blocks, sum(p.shape[0] for p in parts), parts[0].cols, segments)

    @functools.cached_property
    def _desc(self) -> WeightDesc:
        types, rows = zip(*self.segments, strict=True) if self.segments else ((), ())
        segs = ctypes.c_int64 * MAX_SEGMENTS
        return WeightDesc(self.panels.data_ptr(), len(types), segs(*types), segs(*rows))

    @property
    def desc(self) -> int:
        """The address of its `mg_weight`, built once (the panels outlive it)."""
        return ctypes.addressof(self._desc)
