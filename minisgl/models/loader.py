"""Load a checkpoint straight into this rank's shards, one tensor at a time: HF safetensors, or a
GGUF file under transformers' names (its linear weights kept as blocks for the C kernels where
they serve the type), or an FP8 checkpoint (weights kept fp8 for FP8 tensor cores, else
dequantized; its KV scales to `model.kv_scales`). docs/models.md has the details. Every weight
the model needs is tracked by the checkpoint name that provides it, so a missing piece fails
the load by name instead of serving garbage."""

import itertools
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from functools import partial
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
from minisgl.layers.moe import EXPERT_PIECES, Experts
from minisgl.models.default_model import GGUF_FILE, GGUF_INDEX
from minisgl.models.llama import CausalLM
from minisgl.models.model_config import ModelConfig
from minisgl.models.resolve import checkpoint_files

logger = logging.getLogger(__name__)
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
_FP8_SCALE_RE = re.compile(r"\.(weight_scale(_inv)?|input_scale|q_scale)$")  # with weights; unused
_KV_SCALE_RE = re.compile(r"layers\.(\d+)\.self_attn\.(?:.+\.)?([kv])_scale$")
FP8_METHODS = ("fp8", "compressed-tensors")  # quant_method values whose weights load here
DEFAULT_FP8_BLOCK = (128, 128)
_MISSING_SHOWN = 8


# A checkpoint tensor's destination: copies this rank's part of it into the model.
Target = Callable[[Weight], None]


def checkpoint_targets(model: CausalLM) -> dict[str, Target]:
    """Every checkpoint tensor the model needs, by its hub name (a tied lm_head's is not one),
    and where it goes: merged parts (`q_proj`) into their layer (`qkv_proj`), experts one by
    one, every other parameter under its own name."""
    targets: dict[str, Target] = {}
    for prefix, module in model.named_modules():
        parent = prefix.rpartition(".")[0]
        if isinstance(module, ColumnParallelLinear):
            for part, kind in itertools.product(module.part_names, ("weight", "bias")):
                if (param := getattr(module, kind)) is not None:
                    targets[f"{parent}.{part}.{kind}"] = partial(module.load_part, param, part=part)
        elif isinstance(module, Experts):
            for expert, piece in itertools.product(range(module.num_experts), EXPERT_PIECES):
                name = f"{prefix}.{expert}.{piece}.weight"
                targets[name] = partial(module.load_piece, name, expert=expert, piece=piece)
        else:
            for name, param in module.named_parameters(prefix, recurse=False):
                if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
                    targets[name] = partial(module.load_weight, param)
                else:
                    targets[name] = partial(_copy, name, param)
    if model.cfg.tie_word_embeddings:
        del targets["lm_head.weight"]  # the embedding's
    return targets


def _copy(name: str, param: nn.Parameter, full: Weight) -> None:
    if param.shape != (full := dense(full)).shape:
        raise ValueError(
            f"weight '{name}': checkpoint {tuple(full.shape)}, model {tuple(param.shape)}"
        )
    param.data.copy_(full)


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
    cfg: ModelConfig, wanted: Iterable[str], model_dir: Path, blocks: CpuKernels | None
) -> Iterator[tuple[str, Weight]]:
    import gguf

    index = json.loads((model_dir / GGUF_INDEX).read_text())
    arch, dequantized = index["architecture"], set()
    arch_id = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, cfg.num_layers)
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
    cfg, modules, targets = model.cfg, dict(model.named_modules()), checkpoint_targets(model)
    if (model_dir / GGUF_FILE).exists():
        tensors = _gguf(cfg, [*targets, "lm_head.weight"], model_dir, blocks)
    else:
        tensors = _safetensors(model_dir, keep_fp8)
    for name, tensor in tensors:
        if cfg.architecture.endswith("Model"):  # a base model's weights: the decoder's alone
            name = f"model.{name}"
        if _IGNORED_RE.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # (tied: the embedding provides it)
        if kv_scale := _KV_SCALE_RE.search(name):
            model.kv_scales[int(kv_scale[1]), "kv".index(kv_scale[2])] = float(dense(tensor))
            continue
        experts = modules.get(name.rpartition(".")[0])
        for piece_name, piece in (
            experts.unfuse(name, dense(tensor))
            if isinstance(experts, Experts)  # transformers 5.x's fused layout
            else [(name, tensor)]
        ):
            if (target := targets.pop(piece_name, None)) is None:
                raise _unexpected(piece_name, cfg)
            target(piece)
    if missing := sorted(targets):
        shown = ", ".join(missing[:_MISSING_SHOWN])
        more = f" and {len(missing) - _MISSING_SHOWN} more" if len(missing) > _MISSING_SHOWN else ""
        hint = ""
        if cfg.moe is not None and any(".experts." in n for n in missing):
            hint = f" (config.json says num_experts={cfg.moe.num_experts})"
        raise ValueError(f"checkpoint {model_dir} lacks weights: {shown}{more}{hint}")


def _unexpected(name: str, cfg: ModelConfig) -> ValueError:
    if (expert := _EXPERT_RE.search(name)) and cfg.moe is not None:
        return ValueError(
            f"weight '{name}': expert {expert[1]} out of range (config.json says "
            f"num_experts={cfg.moe.num_experts})"
        )
    return ValueError(f"unexpected weight '{name}' in checkpoint")
