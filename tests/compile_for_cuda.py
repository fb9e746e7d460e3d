"""Compile our Triton kernels for NVIDIA GPUs on a machine without one
(tests/test_cuda_compile.py): the fused layer kernels, sampling, attention and fused MoE.

Triton's interpreter (how CI runs the kernels) never lowers them, so a kernel that interprets
fine can still fail to compile for a GPU. Triton compiles to a cubin without any GPU present
(its wheel carries ptxas): this script runs each host wrapper on small CPU tensors with the
kernel launches recorded instead of run, and compiles every recorded launch for the given
architectures, with the argument types and compile-time constants the wrapper chose.

Must run with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).

    python tests/compile_for_cuda.py 90 80
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}
_OPTIONS = ("num_warps", "num_stages")
_INT32_MAX = 2**31 - 1


@dataclass
class Launch:
    kernel: JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]

    @property
    def label(self) -> str:
        types = ",".join(v for v in self.signature.values() if v != "constexpr")
        return f"{self.kernel.fn.__name__}({types}) {self.constexprs}"


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -_INT32_MAX - 1 <= value <= _INT32_MAX else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class Recorder:
    """Stands in for `kernel[grid]`: records the call's types instead of launching."""

    def __init__(self, kernel: JITFunction, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._record

    def _record(self, *args: Any, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        values = dict(zip(self.kernel.arg_names, args, strict=False)) | kwargs
        signature, constexprs = {}, {}
        for param in self.kernel.params:
            value = values.get(param.name, param.default)
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _arg_type(value)
        self.launches.append(Launch(self.kernel, signature, constexprs, options))


def record(module: Any, wrappers: Callable[[], None]) -> list[Launch]:
    """Run `wrappers` with every JIT kernel of `module` replaced by a recorder."""
    launches: list[Launch] = []
    kernels = {n: k for n, k in vars(module).items() if isinstance(k, JITFunction)}
    for name, kernel in kernels.items():
        setattr(module, name, Recorder(kernel, launches))
    try:
        wrappers()
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    return launches


def fused_layer_launches() -> list[Launch]:
    from minisgl.kernels import triton_fused as tf
    from minisgl.layers.rope import RopeConfig, RotaryEmbedding

    def run() -> None:
        rope = RotaryEmbedding(128, 64, RopeConfig(1e6))
        positions = torch.arange(3)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(3, 1024, dtype=dtype)
            w = torch.ones(1024, dtype=dtype)
            tf.rmsnorm(x, w, 1e-6)
            tf.rmsnorm(x, w, 1e-6, x.clone())
            tf.rmsnorm(torch.randn(3, 5120, dtype=dtype), torch.ones(5120, dtype=dtype), 1e-6)
            qkv = torch.randn(3, 32 * 128, dtype=dtype)
            q = qkv[:, : 16 * 128].view(3, 16, 128)
            k = qkv[:, 16 * 128 : 24 * 128].view(3, 8, 128)
            v = qkv[:, 24 * 128 :].view(3, 8, 128)
            hw = torch.ones(128, dtype=dtype)
            tf.qk_norm_rope(q, k, positions, rope.cos_cache, rope.sin_cache, hw, hw, 1e-6)
            tf.qk_norm_rope(q, k, positions, rope.cos_cache, rope.sin_cache, None, None, 0.0)
            tf.silu_mul(torch.randn(3, 2 * 3072, dtype=dtype))
            cache = torch.zeros(16, 8, 128, dtype=dtype)
            tf.store_kv(k, v, cache, cache.clone(), torch.tensor([1, 5, 9]))

    return record(tf, run)


def sampling_launches() -> list[Launch]:
    from minisgl.kernels import triton_sampling as ts

    def run() -> None:
        rows = 3
        temps, seeds, positions = torch.ones(rows), torch.arange(rows), torch.arange(rows)
        for dtype in (torch.float32, torch.bfloat16):
            ts.sample(torch.randn(rows, 1000, dtype=dtype), temps, seeds, positions)

    return record(ts, run)


def attention_launches() -> list[Launch]:
    from minisgl.attention import triton_backend as tb
    from minisgl.kernels import triton_attention as triton_kernels

    def run() -> None:
        for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128)):
            heads, kv_heads, seqs, slots = 16, 8, 3, 64
            q = torch.randn(seqs, heads, head_dim, dtype=dtype)
            cache = torch.zeros(slots, kv_heads, head_dim, dtype=dtype)
            table = torch.zeros(seqs, slots, dtype=torch.int32)
            rows, lens = torch.arange(seqs), torch.tensor([5, 9, 30])
            part_out = torch.zeros(seqs, heads, 4, head_dim)
            part_lse = torch.zeros(seqs, heads, 4)
            decodes = tb.TritonDecodeMetadata(rows, lens, rows, table, part_out, part_lse, 4)
            tb.decode_attention(q, cache, cache, torch.empty_like(q), decodes, 0.1)
            block_map = tb.extend_block_map([2, 4, 1], tb.extend_block_m(head_dim))
            extend = tb.TritonExtendMetadata(
                rows, torch.tensor([3, 5, 29]), lens, rows, table, block_map, None
            )
            q = torch.randn(7, heads, head_dim, dtype=dtype)
            tb.extend_attention(q, cache, cache, torch.empty_like(q), extend, 0.1)

    return record(triton_kernels, run)


def moe_launches() -> list[Launch]:
    from minisgl.kernels import triton_moe as moe

    def run() -> None:
        for dtype in (torch.bfloat16, torch.float32):
            for tokens in (2, 300):  # both block sizes
                x = torch.randn(tokens, 256, dtype=dtype)
                gate_up = torch.randn(8, 2 * 128, 256, dtype=dtype)
                down = torch.randn(8, 256, 128, dtype=dtype)
                weights, ids = torch.rand(tokens, 2), torch.randint(0, 8, (tokens, 2))
                moe.fused_moe(x, gate_up, down, weights, ids)

    return record(moe, run)


def main(archs: list[int]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    launches = fused_layer_launches() + sampling_launches() + attention_launches() + moe_launches()
    assert launches, "no kernel launch was recorded"
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for launch in launches:
            src = ASTSource(launch.kernel, launch.signature, constexprs=launch.constexprs)
            compiled = triton.compile(src, target=target, options=launch.options)
            assert compiled.asm.get("cubin"), launch.label
            print(f"sm_{arch} ok  {launch.label}")
    print(f"compiled {len(launches)} launches for {len(archs)} architectures")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90])
