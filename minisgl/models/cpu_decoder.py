"""The dense decoder stack as one CPU-kernel call per decode step (minisgl/kernels).

`mg_decode_layers` runs the op-by-op path's kernels in the same order (so the same numbers) with
no Python between them, which walking the layers would add to a step (RESULTS.md section 10).
It is built only where it applies: CPU kernels on, one tp rank, dense MLPs, and attention shapes
the decode kernel supports; everything else runs op by op."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

from torch import Tensor

from minisgl.distributed import get_tp_info
from minisgl.kernels.cpu_abi import LayerWeights, StackShape, ptr
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kvcache.pool import KVPool
from minisgl.layers.moe import SparseMoeBlock

if TYPE_CHECKING:  # llama.py builds the stack: only its types here
    from minisgl.models.llama import CausalLM, DecoderLayer


class CpuDecodeStack:
    def __init__(
        self, model: CausalLM, kernels: CpuKernels, shape: StackShape, layers: ctypes.Array
    ) -> None:
        # the model's own modules around the stack (profile_decode.py times them)
        self.embed, self.norm = model.model.embed_tokens, model.model.norm
        self.lm_head = model.lm_head
        self.kernels = kernels
        self.shape = shape
        self._layers = layers  # what `shape.layers` points into (the tensors are the model's)
        # float64 [len(DECODE_OPS)]: when set, each step adds its per-op wall time here
        # (benchmark/offline/profile_decode.py).
        self.op_seconds: Tensor | None = None

    @staticmethod
    def build(model: CausalLM, kernels: CpuKernels) -> CpuDecodeStack | None:
        """None when the stack is not one the fused call covers (see the module docstring)."""
        cfg = model.cfg
        layers = cast("list[DecoderLayer]", list(model.model.layers))
        if get_tp_info().size != 1 or not layers:
            return None
        attn0 = layers[0].self_attn
        heads = (attn0.num_heads, attn0.num_kv_heads, attn0.head_dim)
        if not kernels.supports_decode_attention(*heads):
            return None
        weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, SparseMoeBlock) or mlp.down_proj.bias is not None:
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.packed is None for lin in linears) or attn.o_proj.bias is not None:
                return None
            qkv, o, gate_up, down = (lin.packed for lin in linears)
            in_norm, post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            q_norm, k_norm = (None if n is None else n.weight for n in (attn.q_norm, attn.k_norm))
            # in mg_layer's order (LayerWeights)
            ptrs = (in_norm, post_norm, qkv, attn.qkv_proj.bias, q_norm, k_norm, o, gate_up, down)
            weights.append(LayerWeights(*map(ptr, ptrs)))
        array = (LayerWeights * len(weights))(*weights)
        rope = attn0.rope
        shape = StackShape(
            len(layers),
            cfg.hidden_size,
            *heads,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.rms_norm_eps,  # the q/k norms' (config.json has one)
            attn0.scale,
            rope.cos_cache.data_ptr(),
            rope.sin_cache.data_ptr(),
            ctypes.cast(array, ctypes.POINTER(LayerWeights)),
        )
        return CpuDecodeStack(model, kernels, shape, array)

    def forward(
        self,
        token_table: Tensor,
        page_table: Tensor,
        table_rows: Tensor,
        positions: Tensor,
        pool: KVPool,
    ) -> Tensor:
        """The model's forward for a decode-only batch: sequence i computes the token at
        positions[i] of table row table_rows[i] (int64 [seqs]) and samples. Writes each token's
        K/V to that position's slot of the pool; returns logits [seqs, vocab] in fp32."""
        hidden = self.embed(token_table[table_rows, positions].long()).contiguous()
        out_slots = page_table[table_rows, positions].long()
        self.kernels.decode_layers(
            self.shape,
            hidden,
            positions,
            out_slots,
            page_table,
            table_rows,
            positions + 1,
            pool.buffer,
            pool.scales,
            self.op_seconds,
        )
        # decode_layers leaves the input of the final norm in `hidden`
        return self.lm_head.compute_logits(self.norm(hidden)).float()
