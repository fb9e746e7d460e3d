"""Load HF safetensors checkpoints straight into this rank's shards, one tensor at a time.

Every weight the model needs is tracked by the checkpoint tensor name that provides it (hub
layout: `q_proj`, `experts.3.up_proj`, ...), so a checkpoint that lacks any piece of a merged or
expert weight fails at load with the missing tensor's name instead of serving garbage.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import DOWN_PIECE, EXPERT_PIECES, GATE_UP_PIECES, Experts
from minisgl.models.llama import CausalLM
from minisgl.models.resolve import checkpoint_files

_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
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


def load_weights(model: CausalLM, model_dir: Path) -> None:
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    merged = _merged_parts(model)
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _IGNORED_RE.search(name):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding already provides it
                loaded |= _load_one(name, f.get_tensor(name), params, modules, merged)
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
    tensor: torch.Tensor,
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    merged: dict[str, ColumnParallelLinear],
) -> set[str]:
    """Copy one checkpoint tensor into place; returns the checkpoint names it accounts for."""
    expert = _EXPERT_RE.match(name)
    if expert and isinstance(experts := modules.get(expert.group(1)), Experts):
        experts.load_piece(name, tensor, expert.group(3), int(expert.group(2)))
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
        module.load_fused(name, tensor, param)
        pieces = GATE_UP_PIECES if kind == "gate_up_proj" else (DOWN_PIECE,)
        return {f"{prefix}.{e}.{p}.weight" for e in range(module.num_experts) for p in pieces}
    if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        module.load_weight(param, tensor)
    elif param.shape != tensor.shape:
        raise ValueError(
            f"weight '{name}': checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
        )
    else:
        param.data.copy_(tensor)
    return {name}
