"""Sparse mixture-of-experts block (Qwen3-MoE): a top-k softmax router over SiLU-gated experts.

Experts are tensor parallel over their intermediate dimension like a dense MLP (the router is
replicated, the partial outputs all-reduced once). Weights are fused per layer as transformers
5.x keeps them, `gate_up_proj` [experts, 2 * inter_shard, hidden] and `down_proj` [experts,
hidden, inter_shard]; hub checkpoints' one tensor per expert and projection loads too."""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.kernels.gpu import triton_kernels
from minisgl.kernels.weights import FP8_GROUP, Fp8Tensor, Weight, dense
from minisgl.layers.linear import freed, frozen

# The per-expert projections of the hub layout, in the order they sit in `gate_up_proj` / alone.
GATE_UP_PIECES = ("gate_proj", "up_proj")
DOWN_PIECE = "down_proj"
EXPERT_PIECES = (*GATE_UP_PIECES, DOWN_PIECE)


@dataclass(frozen=True)
class MoeConfig:
    """Where and how a decoder uses experts (models/config.py parses it from config.json)."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # per expert (moe_intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_step: int = 1  # decoder_sparse_step: every sparse_step-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP regardless

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in "
                f"[1, num_experts ({self.num_experts})]"
            )
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step ({self.sparse_step}) must be >= 1")

    def is_sparse(self, layer_id: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.sparse_step == 0


class TopKRouter(nn.Module):
    """Softmax over all experts in fp32, keep the top k (optionally renormalised)."""

    def __init__(self, hidden_size: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = frozen(torch.empty(cfg.num_experts, hidden_size))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, top_k] fp32, expert ids [tokens, top_k])."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids


class Experts(nn.Module):
    """This rank's slice of every expert; forward returns the partial (pre-all-reduce) output.
    An FP8 checkpoint's pieces loaded as `Fp8Tensor`s wait in `_fp8_pieces` for `use_fp8`."""

    fp8: tuple[Fp8Tensor, ...] | None = None  # gate_up, down: [experts, rows, cols] each

    def __init__(self, hidden_size: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.full_inter = cfg.intermediate_size
        self.inter_shard = divide(
            cfg.intermediate_size, get_tp_info().size, "moe_intermediate_size"
        )
        self.gate_up_proj = frozen(torch.empty(cfg.num_experts, 2 * self.inter_shard, hidden_size))
        self.down_proj = frozen(torch.empty(cfg.num_experts, hidden_size, self.inter_shard))
        # The Triton kernel where the fused layer kernels apply (CUDA, Triton importable, not
        # MINISGL_FUSED_KERNELS=0: kernels/gpu.py); else moe_torch.
        self.use_triton = (
            self.down_proj.is_cuda
            and triton_kernels("triton_fused", self.down_proj.device) is not None
        )
        self._fp8_pieces: dict[tuple[int, str], Weight] = {}

    def load_piece(self, name: str, full: Weight, expert: int, piece: str) -> None:
        """Copy this rank's slice of one expert's projection `piece` (the hub layout,
        `experts.{expert}.{piece}.weight`); an FP8 one waits in `_fp8_pieces` for `use_fp8`."""
        shard, down, hidden = self.inter_shard, piece == DOWN_PIECE, self.down_proj.shape[1]
        _check_shape(name, full, (hidden, self.full_inter) if down else (self.full_inter, hidden))
        # this rank's slice of the intermediate dim: down_proj's columns, gate/up's rows
        cut = full.narrow(1 if down else 0, get_tp_info().rank * shard, shard)
        if isinstance(full, Fp8Tensor):
            self._fp8_pieces[expert, piece] = cut
        else:
            self._write(expert, piece, dense(cut))

    def unfuse(self, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        """A fused tensor (transformers 5.x in-memory layout, `experts.gate_up_proj` or
        `experts.down_proj`) as the hub layout's tensors, one per expert and projection."""
        prefix, _, kind = name.rpartition(".")
        down = kind == DOWN_PIECE
        hidden, inter = self.down_proj.shape[1], self.full_inter
        _check_shape(
            name,
            full,
            (self.num_experts, hidden, inter) if down else (self.num_experts, 2 * inter, hidden),
        )
        pieces = (DOWN_PIECE,) if down else GATE_UP_PIECES
        for expert, stacked in enumerate(full):
            for piece, part in zip(pieces, stacked.chunk(len(pieces)), strict=True):
                yield f"{prefix}.{expert}.{piece}.weight", part

    def _write(self, expert: int, piece: str, cut: Tensor) -> None:
        """This rank's slice of one expert's projection into the weights."""
        if piece == DOWN_PIECE:
            self.down_proj.data[expert].copy_(cut)
            return
        offset = GATE_UP_PIECES.index(piece) * self.inter_shard
        self.gate_up_proj.data[expert, offset : offset + self.inter_shard].copy_(cut)

    def use_fp8(self) -> bool:
        """After loading: multiply by the FP8 pieces loaded in place of the weights (whether it
        does), if every piece is fp8 in 128-column groups; else they dequantize into them."""
        pieces, self._fp8_pieces, num = self._fp8_pieces, {}, self.num_experts
        fp8 = {k: p for k, p in pieces.items() if isinstance(p, Fp8Tensor) and p.group == FP8_GROUP}
        if not pieces or len(fp8) < len(pieces):
            for (expert, piece), p in pieces.items():
                self._write(expert, piece, dense(p))
            return False
        # gate_up, then down: every expert's pieces stacked by rows, seen as [experts, rows, cols]
        stacked = (
            Fp8Tensor.cat([fp8[e, p] for e in range(num) for p in pieces], self.down_proj.device)
            for pieces in (GATE_UP_PIECES, (DOWN_PIECE,))
        )
        self.fp8 = tuple(
            Fp8Tensor(w.data.unflatten(0, (num, -1)), w.scale.unflatten(0, (num, -1)), FP8_GROUP)
            for w in stacked
        )
        self.gate_up_proj, self.down_proj = freed(self.gate_up_proj), freed(self.down_proj)
        return True

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if self.fp8 is not None or self.use_triton:
            from minisgl.kernels.triton_moe import fused_moe

            if self.fp8 is not None:
                gate_up, down = self.fp8
                scales = (gate_up.scale, down.scale)
                return fused_moe(x, gate_up.data, down.data, topk_weights, topk_ids, scales)
            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return moe_torch(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


def _check_shape(name: str, tensor: Weight, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"weight '{name}': checkpoint shape {tuple(tensor.shape)}, expected {expected} "
            "from config.json (num_experts, hidden_size, moe_intermediate_size)"
        )


def moe_torch(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    """Reference path (CPU): loop over the experts that received tokens.

    x [tokens, hidden]; gate_up [experts, 2 * inter, hidden]; down [experts, hidden, inter];
    topk_weights / topk_ids [tokens, top_k]. Returns sum_k w_k * expert_k(x) per token.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    flat_weights = topk_weights.flatten().to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tokens, y * flat_weights[pairs, None])
    return out


class SparseMoeBlock(nn.Module):
    """Drop-in for a dense MLP: [tokens, hidden] -> [tokens, hidden], reduced over tp ranks."""

    def __init__(self, hidden_size: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, cfg)  # HF name: mlp.gate.weight
        self.experts = Experts(hidden_size, cfg)

    def forward(self, x: Tensor) -> Tensor:
        topk_weights, topk_ids = self.gate(x)
        return all_reduce(self.experts(x, topk_weights, topk_ids))
