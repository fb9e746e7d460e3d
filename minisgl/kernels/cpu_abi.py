"""The CPU kernels' C interface as ctypes sees it: each function's signature, the structs the
fused decode stack reads, and the constants shared with csrc/ (kept in step by hand; `load`
checks the ABI version and the op count)."""

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from minisgl.kernels.weights import PackedLinear

ABI_VERSION = 10  # MG_ABI_VERSION in csrc/common.h
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
# the KV pool formats besides fp32 (0) that the kernels read and write, as their `kv_format`
# argument (csrc/common.h: fp8's exponent bits, then KV_F16 and KV_BF16)
KV_FORMATS = {torch.float8_e4m3fn: 4, torch.float8_e5m2: 5, torch.float16: 16, torch.bfloat16: 17}


def ptr(x: Tensor | PackedLinear | int | None) -> int | None:
    """What a pointer argument gets: a tensor's data, a packed weight's `mg_weight`, an address
    as it is, or NULL (None)."""
    if isinstance(x, Tensor):
        return x.data_ptr()
    return x.desc if isinstance(x, PackedLinear) else x


class _Pointer:
    """The argument type "P": whatever `ptr` takes, passed as that address."""

    @staticmethod
    def from_param(x: Tensor | PackedLinear | int | None) -> Any:
        return ctypes.c_void_p.from_param(ptr(x))


# Argument and return types as `struct` format characters: P a pointer (`_Pointer`), q int64,
# i int, f float, s a status int (raises unless 0; "" returns nothing), t a last int argument
# that `load` fills in at every call: the thread count (torch's, whose OpenMP pool they run on).
_CTYPES = {
    "P": _Pointer,
    "q": ctypes.c_int64,
    "i": ctypes.c_int,
    "s": ctypes.c_int,
    "f": ctypes.c_float,
    "t": ctypes.c_int,
}
_SIGNATURES = {  # name: (return type, argument types)
    "mg_abi_version": ("i", ""),
    "mg_block_n": ("i", ""),
    "mg_linear": ("", "PqPPPqqqqt"),
    "mg_quant_block_bytes": ("q", "q"),
    "mg_set_int8_activations": ("i", "i"),
    "mg_embed": ("", "PqPqPt"),
    "mg_rmsnorm": ("", "PqqPqPPqqqft"),
    "mg_silu_mul": ("", "PqPqqqt"),
    "mg_rope": ("", "PqqPqqqqPPPt"),
    "mg_store_kv": ("", "PqPqPPPqq"),
    "mg_decode_attention": ("s", "PqPPPPqPPPqqqqqfift"),
    "mg_chunk_attention": ("s", "PqPPPqqPqqqqfift"),
    "mg_decode_scratch_floats": ("q", "Pq"),
    "mg_decode_layers": ("s", "PPqPPPqPPPqiPPPt"),
    "mg_num_ops": ("i", ""),
    "mg_seeded_uniform": ("", "PPqqPt"),
    "mg_sample": ("", "PqPPPqqPt"),
}


def _raise_on_status(status: int, fn: Any, args: tuple[Any, ...]) -> int:
    if status != 0:  # (1: a head layout the kernel does not take, 2: out of memory)
        raise RuntimeError(f"{fn.__name__} failed with status {status}")
    return status


def _with_threads(fn: Any) -> Any:
    """`fn` with its last argument, the thread count, filled in at every call."""
    return lambda *args: fn(*args, torch.get_num_threads())


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with every signature set; raises when it is not this ABI."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _CTYPES.get(restype), [_CTYPES[c] for c in argtypes]
        if restype == "s":
            fn.errcheck = _raise_on_status
        if argtypes.endswith("t"):
            setattr(lib, name, _with_threads(fn))
    if lib.mg_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.mg_abi_version()}, expected {ABI_VERSION}")
    if lib.mg_num_ops() != len(DECODE_OPS):
        raise RuntimeError("the library's op timers do not match DECODE_OPS")
    return lib


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
