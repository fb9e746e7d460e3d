"""The CPU kernels' C interface as ctypes sees it: each function's signature, the structs the
fused decode stack reads, and the constants shared with csrc/ (kept in step by hand; `load`
checks the ABI version and the op count)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from minisgl.kernels.weights import PackedLinear

ABI_VERSION = 8  # MG_ABI_VERSION in csrc/common.h
# mg_decode_layers' op timers, in the C enum's order (MG_NUM_OPS in csrc/decode.c)
DECODE_OPS = (
    "rmsnorm + residual add",
    "qkv_proj",
    "q/k head norm",
    "rope + KV store",
    "decode attention",
    "o_proj",
    "gate_up_proj",
    "silu_mul",
    "down_proj",
)
# decode attention limits (ATTN_MAX_HEADS, ATTN_MAX_HEAD_DIM in csrc/attention.c)
ATTN_MAX_HEADS = 128
ATTN_MAX_HEAD_DIM = 256
# the fp8 KV formats the kernels read and write, as their `fp8` argument (exponent bits)
FP8_KV_FORMATS = {torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ATTN = [_P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float]  # to `scale`
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "mg_abi_version": (ctypes.c_int, []),
    "mg_block_n": (ctypes.c_int, []),
    "mg_linear": (None, [_P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]),
    "mg_quant_block_bytes": (_I, [_I]),
    "mg_set_int8_activations": (ctypes.c_int, [ctypes.c_int]),
    "mg_embed": (None, [_P, _I, _P, _I, _P, ctypes.c_int]),
    "mg_rmsnorm": (None, [_P, _I, _I, _P, _I, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_int]),
    "mg_silu_mul": (None, [_P, _I, _P, _I, _I, _I, ctypes.c_int]),
    "mg_rope": (None, [_P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, ctypes.c_int]),
    "mg_store_kv": (None, [_P, _I, _P, _I, _P, _P, _P, _I, _I]),
    "mg_decode_attention": (ctypes.c_int, [*_ATTN, ctypes.c_int, ctypes.c_float, ctypes.c_int]),
    "mg_decode_scratch_floats": (_I, [_P, _I]),
    "mg_decode_layers": (
        ctypes.c_int,
        [_P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_int, _P, _P, _P, ctypes.c_int],
    ),
    "mg_num_ops": (ctypes.c_int, []),
    "mg_seeded_uniform": (None, [_P, _P, _I, _I, _P, ctypes.c_int]),
    "mg_sample": (None, [_P, _I, _P, _P, _P, _I, _I, _P, ctypes.c_int]),
}


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with every signature set; raises when it is not this ABI."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.mg_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.mg_abi_version()}, expected {ABI_VERSION}")
    if lib.mg_num_ops() != len(DECODE_OPS):
        raise RuntimeError("the library's op timers do not match DECODE_OPS")
    return lib


def ptr(x: torch.Tensor | PackedLinear | None) -> int | None:
    """What a pointer argument gets: a tensor's data, a packed weight's `mg_weight`, or NULL."""
    if x is None:
        return None
    return x.desc if isinstance(x, PackedLinear) else x.data_ptr()


class LayerWeights(ctypes.Structure):
    """`mg_layer`: one dense decoder layer's weights (`mg_weight`s and norms; NULL where absent)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in "input_norm post_norm qkv qkv_bias q_norm k_norm o gate_up down".split()
    ]


class StackShape(ctypes.Structure):
    """`mg_model`: sizes of a dense decoder stack and its layers' weights."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in "num_layers hidden heads kv_heads head_dim".split()],
        ("inter", ctypes.c_int64),
        *[(name, ctypes.c_float) for name in ("eps", "head_norm_eps", "scale")],
        ("cos_cache", ctypes.c_void_p),
        ("sin_cache", ctypes.c_void_p),
        ("layers", ctypes.POINTER(LayerWeights)),
    ]
