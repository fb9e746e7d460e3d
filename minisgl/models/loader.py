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

from minisgl.distributed import get_tp_info
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import EXPERT_PIECES, GATE_UP_PIECES, Experts
from minisgl.models.checkpoint import checkpoint_files
from minisgl.models.config import ModelConfig
from minisgl.models.llama import CausalLM, kv_head_shard_rank

# checkpoint name piece -> (our merged module, part name)
_MERGED_PARTS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_PART_PIECES = {(module, part): piece for piece, (module, part) in _MERGED_PARTS.items()}
_MERGED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
_MISSING_SHOWN = 8


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Every checkpoint tensor (hub layout) the model needs; a tied lm_head is not one."""
    names: set[str] = set()
    claimed: set[str] = set()  # our parameters that merged or expert pieces account for
    for module_name, module in model.named_modules():
        parent, _, leaf = module_name.rpartition(".")
        if isinstance(module, ColumnParallelLinear) and len(module.part_names) > 1:
            for kind, param in (("weight", module.weight), ("bias", module.bias)):
                if param is None:
                    continue
                for part in module.part_names:
                    names.add(f"{parent}.{_PART_PIECES[(leaf, part)]}.{kind}")
                claimed.add(f"{module_name}.{kind}")
        elif isinstance(module, Experts):
            for expert in range(module.num_experts):
                names.update(f"{module_name}.{expert}.{piece}.weight" for piece in EXPERT_PIECES)
            claimed.update(f"{module_name}.{p}" for p, _ in module.named_parameters())
    return names | ({n for n, _ in model.named_parameters()} - claimed)


def load_weights(model: CausalLM, model_dir: Path) -> None:
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _IGNORED_RE.search(name):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding already provides it
                loaded |= _load_one(name, f.get_tensor(name), cfg, params, modules)
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
    cfg: ModelConfig,
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
) -> set[str]:
    """Copy one checkpoint tensor into place; returns the checkpoint names it accounts for."""
    expert = _EXPERT_RE.match(name)
    if expert and isinstance(modules.get(expert.group(1)), Experts):
        module_name, index, piece = expert.groups()
        experts = modules[module_name]
        assert isinstance(experts, Experts)
        experts.load_expert(name, tensor, int(index), piece)
        return {name}
    merged = _MERGED_RE.match(name)
    if merged:
        prefix, piece, kind = merged.groups()
        module_name, part = _MERGED_PARTS[piece]
        full_module = f"{prefix}.{module_name}"
        module = modules.get(full_module)
        if not isinstance(module, ColumnParallelLinear):
            raise ValueError(f"unexpected weight '{name}' in checkpoint")
        shard_rank = kv_head_shard_rank(cfg) if part in ("k", "v") else get_tp_info().rank
        module.load_part(params[f"{full_module}.{kind}"], tensor, part, shard_rank)
        return {name}
    if name not in params:
        raise ValueError(f"unexpected weight '{name}' in checkpoint")
    module_name, _, param_name = name.rpartition(".")
    module = modules[module_name]
    param = params[name]
    if isinstance(module, Experts):  # fused layout: one tensor holds every expert's piece
        module.load_fused(name, tensor, param)
        pieces = GATE_UP_PIECES if param_name == "gate_up_proj" else ("down_proj",)
        return {f"{module_name}.{e}.{p}.weight" for e in range(module.num_experts) for p in pieces}
    if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        module.load_weight(param, tensor)
    else:
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight '{name}': checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
    return {name}
