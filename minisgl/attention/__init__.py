"""Attention backends by name, imported lazily so optional GPU packages stay optional.

`auto` picks FlashInfer on CUDA when the package is importable (and the dtype is fp16/bf16, all
FlashInfer computes), else Triton on CUDA when importable, else the torch-native backend (the
CPU path).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig

# name -> "module:Class", imported on first use
_REGISTRY = {
    "torch": "minisgl.attention.torch_native:TorchNativeBackend",
    "triton": "minisgl.attention.triton_backend:TritonBackend",
    "flashinfer": "minisgl.attention.flashinfer_backend:FlashInferBackend",
}
BACKEND_NAMES = ("auto", *_REGISTRY)


def resolve_backend_name(name: str, device_type: str, dtype: torch.dtype) -> str:
    if name != "auto" or device_type != "cuda":
        return "torch" if name == "auto" else name
    half = dtype in (torch.float16, torch.bfloat16)
    if half and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def create_backend(name: str, cfg: AttentionConfig) -> AttentionBackend:
    name = resolve_backend_name(name, cfg.device.type, cfg.dtype)
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend: unknown '{name}' (choose from {', '.join(BACKEND_NAMES)})"
        )
    module_name, class_name = _REGISTRY[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    backend: AttentionBackend = backend_cls(cfg)
    return backend


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionConfig",
    "create_backend",
    "resolve_backend_name",
]
