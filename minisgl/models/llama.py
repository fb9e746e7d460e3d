"""One decoder for Llama, Mistral-style dense, Qwen2, Qwen3 and Qwen3-MoE checkpoints.

The families differ only in switches read from the config: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings, head_dim, rope scaling, and which layers replace the dense MLP
with a sparse MoE block (Qwen3-MoE). Every projection is tensor parallel.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minisgl.attention.context import get_forward_context
from minisgl.distributed import divide, get_tp_info
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.gpu import layer_kernels
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import SparseMoeBlock
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rope import RotaryEmbedding, qk_norm_rope
from minisgl.models.cpu_decoder import CpuDecodeStack
from minisgl.models.model_config import ModelConfig


def local_head_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(query heads, KV heads) on this rank; KV heads are replicated when scarcer than ranks."""
    tp = get_tp_info().size
    num_heads = divide(cfg.num_heads, tp, "num_attention_heads")
    if cfg.num_kv_heads >= tp:
        return num_heads, divide(cfg.num_kv_heads, tp, "num_key_value_heads")
    if tp % cfg.num_kv_heads != 0:
        raise ValueError(
            f"tp size ({tp}) must be a multiple of num_key_value_heads ({cfg.num_kv_heads}) "
            "when it exceeds it"
        )
    return num_heads, 1


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        head_dim = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = local_head_counts(cfg)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim, cfg.num_kv_heads * head_dim],
            bias=cfg.attention_bias,
            part_names=["q_proj", "k_proj", "v_proj"],
            shard_sizes=[self.num_heads * head_dim, *[self.num_kv_heads * head_dim] * 2],
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.norm_eps = cfg.rms_norm_eps
        self.rope = rope
        self.scale = head_dim**-0.5
        # q/k norm and rope in one call: the Triton kernel, the C kernels' or torch's
        kernels = layer_kernels()
        self.qk_norm_rope = qk_norm_rope if kernels is None else kernels.qk_norm_rope

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).split(self.qkv_proj.shard_sizes, dim=-1)
        q, k, v = (x.view(num_tokens, -1, self.head_dim) for x in qkv)  # [tokens, heads, D]
        q_weight, k_weight = (None if n is None else n.weight for n in (self.q_norm, self.k_norm))
        rope = self.rope
        q, k = self.qk_norm_rope(
            q, k, positions, rope.cos_cache, rope.sin_cache, q_weight, k_weight, self.norm_eps
        )
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, self.layer_id, ctx.kv_pool, ctx.metadata)
        return self.o_proj(out.reshape(num_tokens, -1))  # [tokens, heads * head_dim]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size, cfg.intermediate_size],
            bias=cfg.mlp_bias,
            part_names=["gate_proj", "up_proj"],
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.kernels = layer_kernels()

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe if cfg.moe is not None and cfg.moe.is_sparse(layer_id) else None
        self.mlp: MLP | SparseMoeBlock
        self.mlp = MLP(cfg) if moe is None else SparseMoeBlock(cfg.hidden_size, moe)

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Pre-norm residual stream, carried as (this layer's output, the residual before it):
        the next norm adds them in the same pass (`forward_residual`). The sums are the HF
        model's `hidden + attn(norm(hidden))`, in the same order and dtype."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow HF (`model.layers.N.self_attn...`) so the loader maps them 1:1."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.model = DecoderStack(cfg, rope)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Set by use_cpu_kernels where the fused decode applies (see models/cpu_decoder.py).
        self.cpu_decode_stack: CpuDecodeStack | None = None
        # An FP8 checkpoint's KV cache scales, [layers, 2 (k, v)] (the loader sets them).
        self.kv_scales = torch.ones(cfg.num_layers, 2, device="cpu")

    def forward(self, input_ids: Tensor, positions: Tensor, logit_indices: Tensor) -> Tensor:
        """input_ids, positions: [tokens]; returns logits [len(logit_indices), vocab] in fp32."""
        hidden = self.final_hidden(input_ids, positions, logit_indices)
        return self.lm_head.compute_logits(hidden).float()

    def final_hidden(self, input_ids: Tensor, positions: Tensor, indices: Tensor) -> Tensor:
        """The final norm's output at the tokens `indices` picks, [len(indices), hidden]: what
        the head reads, and what embeddings pool."""
        hidden = self.model.embed_tokens(input_ids)
        residual: Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        assert residual is not None  # (config.json has layers)
        return self.model.norm.forward_residual(hidden[indices], residual[indices])[0]

    def use_cpu_kernels(self, kernels: CpuKernels, fused_decode: bool = True) -> None:
        """Repack every dense weight for the fp32 CPU kernels (after loading; see
        minisgl/kernels/cpu.py). Experts keep their torch path. `fused_decode`: build the
        one-call decode stack where it applies (it does its own attention, so only where the
        torch-native backend is the one in use)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.use_cpu_kernels(kernels)
        embed, tied = self.model.embed_tokens, self.cfg.tie_word_embeddings
        blocks = bool(embed.quant)
        if blocks:  # GGUF blocks: the embedding looks rows up in them, a tied head shares them
            embed.use_cpu_kernels(kernels)
            self.lm_head.packed = embed.packed if tied else None
        self.lm_head.use_cpu_kernels(kernels, keep_weight=tied and not blocks)
        if fused_decode:
            self.cpu_decode_stack = CpuDecodeStack.build(self, kernels)
