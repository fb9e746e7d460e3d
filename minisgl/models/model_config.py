"""The parts of an HF config.json that the engine needs, read once into a frozen dataclass."""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.layers.moe import MoeConfig
from minisgl.layers.rope import RopeConfig

logger = logging.getLogger(__name__)

# architectures -> our model family; all are the same decoder with small switches.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Base models without a head: what sentence-transformers saves (embedding checkpoints)
    "LlamaModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}

# transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out.
_DEFAULT_NUM_EXPERTS = 128
_DEFAULT_TOP_K = 8
_DEFAULT_MOE_INTERMEDIATE = 768


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None  # sparse experts (Qwen3-MoE); None: every layer is dense


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes rope_parameters.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")) or "default")
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(
            f"rope type '{rope_type}' is not supported (default, linear, llama3, yarn)"
        )
    return RopeConfig(theta=theta, rope_type=rope_type, params=params)


def _moe_config(raw: dict[str, Any]) -> MoeConfig | None:
    # transformers 5.x writes num_local_experts; hub checkpoints say num_experts.
    num_experts = raw.get("num_experts", raw.get("num_local_experts", _DEFAULT_NUM_EXPERTS))
    if not num_experts:
        return None  # transformers builds dense MLPs everywhere when there are no experts
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(raw.get("num_experts_per_tok", _DEFAULT_TOP_K)),
        intermediate_size=int(raw.get("moe_intermediate_size", _DEFAULT_MOE_INTERMEDIATE)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_step=int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json (empty when it has none)."""
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what HF generate() stops on; it may hold a list.
    if (eos := _generation_config(model_dir).get("eos_token_id")) is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


# What a checkpoint's generation_config.json may recommend for sampling (Qwen3: temperature 0.6,
# top_k 20, top_p 0.95), under SamplingParams' names.
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(model_dir: Path, source: str = "model") -> dict[str, float | int]:
    """The sampling values the checkpoint's generation_config.json sets (none when it has no
    such file, or when `source`, --sampling-defaults, is "openai"). A server applies them to
    requests that leave those fields unset, as SGLang and vLLM do by default."""
    if source != "model":
        return {}
    raw = _generation_config(model_dir)
    defaults: dict[str, float | int] = {}
    for key in GENERATION_SAMPLING_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # absent, null or malformed: the API's own default applies
        defaults[key] = int(value) if key == "top_k" else float(value)
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        logger.info("sampling defaults from the model's generation_config.json: %s", shown)
    return defaults


def load_model_config(model_dir: Path) -> ModelConfig:
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs} in {model_dir}: "
            f"supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("hidden_act", "silu") != "silu":  # dense MLPs and experts alike
        raise ValueError(f"hidden_act '{raw['hidden_act']}' is not supported (silu)")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope=_rope_config(raw),
        # a base model generates through its embedding, having no head of its own
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)) or arch.endswith("Model"),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),  # per-head q/k norms
        eos_token_ids=_eos_ids(model_dir, raw),
        moe=_moe_config(raw) if family == "qwen3_moe" else None,
    )
