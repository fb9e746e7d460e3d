"""Attention backends by name, imported lazily so optional GPU packages stay optional.

"auto" picks FlashInfer on CUDA when the package is installed and the dtype is fp16/bf16 (all
FlashInfer computes), else our Triton kernels on CUDA when Triton is installed, else
torch-native (every CPU run).
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
# name -> the package it needs, looked up (not imported) when "auto" chooses
_REQUIRED_PACKAGE = {"flashinfer": "flashinfer", "triton": "triton"}
_CUDA_PREFERENCE = ("flashinfer", "triton")
_HALF_ONLY = {"flashinfer"}  # no fp32 kernels


def _usable(name: str, dtype: torch.dtype) -> bool:
    if name in _HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        return False
    return name in _REGISTRY and importlib.util.find_spec(_REQUIRED_PACKAGE[name]) is not None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "auto":
        if device.type == "cuda":
            return next((n for n in _CUDA_PREFERENCE if _usable(n, dtype)), "torch")
        return "torch"
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend: unknown '{name}' (choose from {', '.join(BACKEND_NAMES)})"
        )
    package = _REQUIRED_PACKAGE.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"attention_backend '{name}' needs the '{package}' package installed")
    return name


def create_backend(name: str, cfg: AttentionConfig) -> AttentionBackend:
    name = resolve_backend_name(name, cfg.device, cfg.dtype)
    module_name, class_name = _REGISTRY[name].split(":")
    module = importlib.import_module(module_name)
    if name == "triton" and cfg.device.type != "cuda":
        from minisgl.attention.triton_kernels import INTERPRETER

        if not INTERPRETER:
            raise ValueError(
                "attention_backend 'triton' runs on CUDA; on CPU only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before start-up; slow, meant for tests)"
            )
    backend: AttentionBackend = getattr(module, class_name)(cfg)
    return backend


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionConfig",
    "create_backend",
    "resolve_backend_name",
]
