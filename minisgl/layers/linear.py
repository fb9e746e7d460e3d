"""Tensor-parallel linear layers: each holds only this rank's shard and cuts it from the full
checkpoint tensor as it loads. Column parallel splits the outputs (no communication); row
parallel splits the inputs and all-reduces.

After loading, the weight may change form (docs/architecture.md, "The CPU path"): repacked into
the CPU kernels' panels (`use_cpu_kernels`), kept as GGUF blocks (`quant`), or stacked into one
fp8 weight (`use_fp8`). The model holds one copy of every weight either way."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.weights import Fp8Tensor, PackedLinear, QuantTensor, Weight


def frozen(t: Tensor) -> nn.Parameter:
    """`t` as a parameter that no gradient touches (the loader fills it)."""
    return nn.Parameter(t, requires_grad=False)


def freed(param: nn.Parameter) -> nn.Parameter:
    """An empty stand-in for a weight now held elsewhere (packed, fp8): it keeps the parameter's
    name, and nothing reads it after loading."""
    return frozen(param.data.new_empty(0))


class PackedWeight(nn.Module):
    """The CPU-kernel switch of a layer multiplying by a weight [out, in] (both linear kinds,
    the LM head)."""

    weight: nn.Parameter
    _kernels: CpuKernels | None = None
    packed: PackedLinear | None = None  # the weight in the kernels' layout, once repacked
    quant: dict[int, QuantTensor | Fp8Tensor] | None = None  # loaded in its place, by part
    fp8: Fp8Tensor | None = None  # the weight as fp8, multiplied by `_fp8_linear`
    _fp8_linear: Callable[..., Tensor] | None = None

    def use_cpu_kernels(self, kernels: CpuKernels, keep_weight: bool = False) -> None:
        """Repack the loaded weight for `kernels` (call after loading) and free the original
        unless something else reads it (`keep_weight`)."""
        if self.packed is None:  # else given: a tied head shares the embedding's blocks
            self.packed = (
                PackedLinear.of_blocks(self.quant)  # type: ignore[arg-type]
                if self.quant
                else kernels.pack(self.weight.data)
            )
        self.quant, self._kernels = None, kernels  # blocks live on in `packed` only
        if not keep_weight:
            self.weight = freed(self.weight)

    def use_fp8(self, fp8_linear: Callable[..., Tensor]) -> None:
        """Multiply by the FP8 parts loaded in place of the weight (after loading)."""
        parts = [p for _, p in sorted((self.quant or {}).items()) if isinstance(p, Fp8Tensor)]
        if len(parts) != (len(self.part_names) if isinstance(self, ColumnParallelLinear) else 1):
            raise ValueError("a merged weight mixes fp8 and unquantized parts: not served fp8")
        self.fp8 = Fp8Tensor.cat(parts, self.weight.device)
        self.quant, self._fp8_linear, self.weight = None, fp8_linear, freed(self.weight)

    def _place(self, piece: Weight, part: int, dest: Tensor) -> None:
        """This rank's piece of a checkpoint tensor (of merged part `part`): copied into `dest`,
        or kept as blocks or fp8 (`quant`; an fp8 cut inside a group comes dense)."""
        if isinstance(piece, Tensor):
            dest.copy_(piece)
        else:
            self.quant = {**(self.quant or {}), part: piece}

    def matmul(self, x: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
        """x W^T + bias; with the kernels, into `out` when given ([rows, out], contiguous)."""
        if self._kernels is not None and self.packed is not None:
            return self._kernels.linear(x, self.packed, bias, out)
        if self._fp8_linear is not None:
            return self._fp8_linear(x, self.fp8, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(PackedWeight):
    """y = x W^T with W's rows (outputs) split across ranks; several logical weights merge.

    `output_sizes` are the merged parts' full sizes (e.g. [q, k, v]), named by `part_names` as in
    the checkpoint; this rank holds its even slice of each, unless `shard_sizes` says otherwise (KV
    heads scarcer than ranks: neighbouring ranks then hold the same slice)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        part_names: list[str],
        shard_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.full_sizes = output_sizes
        self.shard_sizes = shard_sizes or [
            divide(size, get_tp_info().size, "output size") for size in output_sizes
        ]
        self.part_names = part_names
        out = sum(self.shard_sizes)
        self.weight = frozen(torch.empty(out, input_size))
        self.bias = frozen(torch.empty(out)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.bias)

    def load_part(self, param: nn.Parameter, full: Weight, part: str) -> None:
        """Copy this rank's slice of checkpoint tensor `full` (the whole of one part)."""
        index = self.part_names.index(part)
        shard = self.shard_sizes[index]
        tp = get_tp_info()
        start = tp.rank * (self.full_sizes[index] // shard) // tp.size * shard
        dest = param.data.narrow(0, sum(self.shard_sizes[:index]), shard)
        self._place(full.narrow(0, start, shard), index, dest)


class RowParallelLinear(PackedWeight):
    """y = x W^T with W's columns (inputs) split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_shard = divide(input_size, get_tp_info().size, "input size")
        self.weight = frozen(torch.empty(output_size, self.input_shard))
        # The bias is added once, after the reduction, so it is held whole on every rank.
        self.bias = frozen(torch.empty(output_size)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: nn.Parameter, full: Weight) -> None:
        if param is not self.bias:  # (held whole)
            full = full.narrow(1, get_tp_info().rank * self.input_shard, self.input_shard)
        self._place(full, 0, param.data)
