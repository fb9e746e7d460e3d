"""Load a checkpoint straight into this rank's shards, one tensor at a time: HF safetensors, or a
GGUF file under transformers' names (its linear weights kept as blocks for the C kernels where
they serve the type), or an FP8 checkpoint (weights kept fp8 for FP8 tensor cores, else
dequantized; its KV scales to `model.kv_scales`). docs/models.md has the details. Every weight
the model needs is tracked by the checkpoint name that provides it, so a missing piece fails
the load by name instead of serving garbage."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor, nn

from minisgl.config import ServerArgs
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.weights import Fp8Tensor, QuantTensor, Weight, dense
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import DOWN_PIECE, EXPERT_PIECES, GATE_UP_PIECES, Experts
from minisgl.models.default_model import GGUF_FILE, GGUF_INDEX
from minisgl.models.llama import CausalLM
from minisgl.models.resolve import checkpoint_files

logger = logging.getLogger(__name__)
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
_FP8_SCALE_RE = re.compile(r"\.(weight_scale(_inv)?|input_scale|q_scale)$")  # with weights; unused
_KV_SCALE_RE = re.compile(r"layers\.(\d+)\.self_attn\.(?:.+\.)?([kv])_scale$")
FP8_METHODS = ("fp8", "compressed-tensors")  # quant_method values whose weights load here
DEFAULT_FP8_BLOCK = (128, 128)
_MISSING_SHOWN = 8


def _merged_parts(model: nn.Module) -> dict[str, ColumnParallelLinear]:
    """The checkpoint prefix of every merged part (`...self_attn.q_proj`) -> the layer that
    holds it (`...self_attn.qkv_proj`)."""
    return {
        f"{name.rpartition('.')[0]}.{part}": module
        for name, module in model.named_modules()
        if isinstance(module, ColumnParallelLinear)
        for part in module.part_names
    }


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Every checkpoint tensor (hub layout) the model needs; a tied lm_head is not one."""
    names = {
        f"{prefix}.{kind}"
        for prefix, module in _merged_parts(model).items()
        for kind in ("weight", "bias")
        if getattr(module, kind) is not None
    }
    claimed: set[str] = set()  # our parameters that merged or expert pieces account for
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            for expert in range(module.num_experts):
                names.update(f"{module_name}.{expert}.{piece}.weight" for piece in EXPERT_PIECES)
        if isinstance(module, (ColumnParallelLinear, Experts)):
            claimed.update(f"{module_name}.{p}" for p, _ in module.named_parameters())
    return names | ({n for n, _ in model.named_parameters()} - claimed)


def _safetensors(model_dir: Path, keep_fp8: bool) -> Iterator[tuple[str, Weight]]:
    quant = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    method, fmt = quant.get("quant_method", "fp8"), quant.get("format")
    if method not in FP8_METHODS or fmt not in (None, "float-quantized"):  # compressed-tensors
        shown = f"'{method}'" + (f" (format {fmt})" if fmt else "")
        raise ValueError(f"quant_method {shown} is not supported (fp8 checkpoints, GGUF files)")
    block, num_fp8 = quant.get("weight_block_size") or DEFAULT_FP8_BLOCK, 0
    with ExitStack() as files:
        shards = [files.enter_context(safe_open(str(p), "pt")) for p in checkpoint_files(model_dir)]
        where = {name: f for f in shards for name in f.keys()}  # noqa: SIM118 (not a dict)
        for name, f in where.items():
            if _FP8_SCALE_RE.search(name):
                continue
            tensor = f.get_tensor(name)
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                fp8, num_fp8 = _fp8(name, tensor, where, block), num_fp8 + 1
                # the GEMM's tiles: a power-of-two group of 16+ columns (checkpoints: 128)
                kept = keep_fp8 and fp8.group >= 16 and fp8.group & (fp8.group - 1) == 0
                yield name, fp8 if kept else fp8.dequantize()
            else:
                yield name, tensor
    if num_fp8:
        how = "loaded fp8" if keep_fp8 else "dequantized at load to the model's dtype"
        logger.info("FP8 checkpoint: %d weights %s", num_fp8, how)


def _fp8(name: str, w: Tensor, where: dict, block: Sequence[int]) -> Fp8Tensor:
    scale_name = next((f"{name}_scale{s}" for s in ("_inv", "") if f"{name}_scale{s}" in where), "")
    if not scale_name or w.dim() != 2:
        raise ValueError(f"FP8 weight '{name}' has no weight_scale_inv or weight_scale, or not 2-D")
    try:
        return Fp8Tensor.of_checkpoint(w, where[scale_name].get_tensor(scale_name), block)
    except ValueError as exc:
        raise ValueError(f"'{scale_name}': {exc}") from None


def _gguf(
    model: CausalLM, model_dir: Path, blocks: CpuKernels | None
) -> Iterator[tuple[str, Weight]]:
    import gguf

    cfg, index = model.cfg, json.loads((model_dir / GGUF_INDEX).read_text())
    arch, dequantized = index["architecture"], set()
    arch_id = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, cfg.num_layers)
    wanted = expected_checkpoint_names(model) | {"lm_head.weight"}  # a tied head's is skipped
    ours = {names.get_name(n, (".weight", ".bias")): n for n in wanted}
    # copy-on-write: the tensors view the file (no copies; a view written would copy a page)
    file = torch.from_numpy(np.memmap(model_dir / GGUF_FILE, mode="c"))
    for gguf_name, qtype, shape, offset in index["tensors"]:
        name, (block, block_bytes) = ours.get(gguf_name), gguf.GGML_QUANT_SIZES[qtype]
        if name is None:
            raise ValueError(f"GGUF tensor '{gguf_name}' has no place in {cfg.architecture}")
        rows = math.prod(shape[1:])  # uint8 [rows, row bytes]
        data = file[offset : offset + rows * shape[0] // block * block_bytes].view(rows, -1)
        if arch == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):  # llama.cpp's rope order
            heads = cfg.num_heads if ".attn_q." in gguf_name else cfg.num_kv_heads
            data = data.view(heads, -1, 2, data.shape[1]).transpose(1, 2).reshape(data.shape)
        weight = QuantTensor(qtype, data, shape[0])
        if blocks is None or len(shape) == 1:
            yield name, weight.dequantize().view(*reversed(shape))
        elif blocks.serves_blocks(qtype):
            yield name, weight
        else:
            dequantized.add(gguf.GGMLQuantizationType(qtype).name)
            yield name, QuantTensor.of_float(weight.dequantize())
    if dequantized:
        shown = ", ".join(sorted(dequantized))
        logger.info("GGUF %s weights are dequantized to fp32 at load (not served as blocks)", shown)


def gguf_blocks(
    args: ServerArgs, model_dir: Path, kernels: CpuKernels | None, where: str
) -> CpuKernels | None:
    """The kernels to serve a GGUF model's weights as blocks (--quantization), or None."""
    is_gguf, q = (model_dir / GGUF_FILE).exists(), args.quantization
    if q == "gguf" and (kernels is None or not is_gguf):
        why = f"the fp32 CPU kernels (not {where})" if is_gguf else "a GGUF model (--model x.gguf)"
        raise ValueError(f"--quantization gguf needs {why}")
    blocks = is_gguf and kernels is not None and (q == "gguf" or args.dtype == q == "auto")
    if is_gguf and q == "auto" and not blocks:
        logger.info("GGUF weights dequantized to %s (blocks: CPU, --dtype auto)", where)
    return kernels if blocks else None


def load_weights(
    model: CausalLM, model_dir: Path, blocks: CpuKernels | None = None, keep_fp8: bool = False
) -> None:
    """`blocks`: GGUF weights stay blocks for these kernels; `keep_fp8`: an FP8 checkpoint's
    linear weights stay fp8 (see the module docstring)."""
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    merged = _merged_parts(model)
    loaded: set[str] = set()
    gguf_path = model_dir / GGUF_FILE
    tensors = (
        _gguf(model, model_dir, blocks) if gguf_path.exists() else _safetensors(model_dir, keep_fp8)
    )
    for name, tensor in tensors:
        if _IGNORED_RE.search(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding already provides it
        if kv_scale := _KV_SCALE_RE.search(name):
            model.kv_scales[int(kv_scale[1]), "kv".index(kv_scale[2])] = float(dense(tensor))
            continue
        loaded |= _load_one(name, tensor, params, modules, merged)
    missing = sorted(expected_checkpoint_names(model) - loaded)
    if missing:
        shown = ", ".join(missing[:_MISSING_SHOWN])
        more = f" and {len(missing) - _MISSING_SHOWN} more" if len(missing) > _MISSING_SHOWN else ""
        hint = ""
        if cfg.moe is not None and any(".experts." in n for n in missing):
            hint = f" (config.json says num_experts={cfg.moe.num_experts})"
        raise ValueError(f"checkpoint {model_dir} lacks weights: {shown}{more}{hint}")


def _load_one(
    name: str,
    tensor: Weight,
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    merged: dict[str, ColumnParallelLinear],
) -> set[str]:
    """Copy one checkpoint tensor into place; returns the checkpoint names it accounts for."""
    expert = _EXPERT_RE.match(name)
    if expert and isinstance(experts := modules.get(expert.group(1)), Experts):
        piece = tensor if isinstance(tensor, Fp8Tensor) else dense(tensor)
        experts.load_piece(name, piece, expert.group(3), int(expert.group(2)))
        return {name}
    prefix, _, kind = name.rpartition(".")
    if prefix in merged:  # q_proj.weight, into qkv_proj.weight
        layer = merged[prefix]
        layer.load_part(getattr(layer, kind), tensor, prefix.rpartition(".")[2])
        return {name}
    if name not in params:
        raise ValueError(f"unexpected weight '{name}' in checkpoint")
    module, param = modules[prefix], params[name]
    if isinstance(module, Experts):  # fused layout: one tensor holds every expert's piece
        module.load_fused(name, dense(tensor), param)
        pieces = GATE_UP_PIECES if kind == "gate_up_proj" else (DOWN_PIECE,)
        return {f"{prefix}.{e}.{p}.weight" for e in range(module.num_experts) for p in pieces}
    if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        module.load_weight(param, tensor)
        return {name}
    if param.shape != (tensor := dense(tensor)).shape:
        raise ValueError(
            f"weight '{name}': checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
    return {name}
