"""Load HF safetensors checkpoints straight into this rank's shards, one tensor at a time."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
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
_MERGED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


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
                target = _load_one(name, f.get_tensor(name), cfg, params, modules)
                loaded.add(target)
    # named_parameters() lists a tied weight once, under the embedding's name.
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {', '.join(missing[:8])}")


def _load_one(
    name: str,
    tensor: torch.Tensor,
    cfg: ModelConfig,
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
) -> str:
    merged = _MERGED_RE.match(name)
    if merged:
        prefix, piece, kind = merged.groups()
        module_name, part = _MERGED_PARTS[piece]
        full_module = f"{prefix}.{module_name}"
        module = modules[full_module]
        assert isinstance(module, ColumnParallelLinear)
        shard_rank = kv_head_shard_rank(cfg) if part in ("k", "v") else get_tp_info().rank
        module.load_part(params[f"{full_module}.{kind}"], tensor, part, shard_rank)
        return f"{full_module}.{kind}"
    if name not in params:
        raise ValueError(f"unexpected weight '{name}' in checkpoint")
    module = modules[name.rsplit(".", 1)[0]]
    param = params[name]
    if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        module.load_weight(param, tensor)
    else:
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight '{name}': checkpoint {tuple(tensor.shape)}, model {param.shape}"
            )
        param.data.copy_(tensor)
    return name
