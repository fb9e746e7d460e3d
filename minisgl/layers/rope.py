"""Rotary position embedding (neox layout: rotate halves), with the scalings Llama/Qwen use."""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from minisgl.layers.norm import rms_norm


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings read from a checkpoint's config (models/config.py parses them)."""

    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    params: dict[str, Any] = field(default_factory=dict)  # the rest of rope_scaling


def _llama3_inv_freq(inv_freq: Tensor, p: dict) -> Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict, max_pos: int) -> tuple[Tensor, float]:
    factor = p["factor"]
    orig_max = p.get("original_max_position_embeddings") or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if (attention_factor := p.get("attention_factor")) is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    unscaled = 1 - ramp  # each frequency's weight of extrapolation (its unscaled value)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - unscaled) + (1.0 / pos_freqs) * unscaled
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position, computed once (the rotation itself: `qk_norm_rope`)."""

    def __init__(self, head_dim: int, max_positions: int, cfg: RopeConfig) -> None:
        super().__init__()
        inv_freq = 1.0 / cfg.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        scale = 1.0
        if cfg.rope_type == "linear":
            inv_freq = inv_freq / cfg.params["factor"]
        elif cfg.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, cfg.params)
        elif cfg.rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(cfg.theta, head_dim, cfg.params, max_positions)
        # [max_positions, head_dim / 2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos_cache: Tensor
        self.sin_cache: Tensor
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """Qwen3's per-head RMSNorm of q [tokens, heads, head_dim] and k [tokens, kv_heads,
    head_dim] (none when the weights are None), then the rotation by the cos/sin rows of
    `positions`, in torch ops: the reference of the kernels' `qk_norm_rope`, which share this
    signature (the Triton one returns new tensors, the C one rotates q and k in place)."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)  # [tokens, 1, head_dim]
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
