"""Attention backends by name, imported lazily so optional GPU packages stay optional.

"auto" picks FlashInfer on CUDA when the package is installed and the dtype is fp16/bf16 (all
FlashInfer computes), else our Triton kernels on CUDA when Triton is installed, else
torch-native (every CPU run).
"""

import importlib
import importlib.util

import torch

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig

# name -> (module, class), imported on first use
_REGISTRY = {
    "torch": ("minisgl.attention.torch_native", "TorchNativeBackend"),
    "triton": ("minisgl.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("minisgl.attention.flashinfer_backend", "FlashInferBackend"),
}
# The CUDA backends in the order "auto" prefers them; each needs the package of its name (looked
# up, not imported, when "auto" chooses).
_CUDA_PREFERENCE = ("flashinfer", "triton")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`name`: one of --attention-backend's choices (ServerArgs checks them)."""
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        half = dtype in (torch.float16, torch.bfloat16)
        # (FlashInfer has no fp32 kernels)
        usable = (n for n in _CUDA_PREFERENCE if _installed(n) and (half or n != "flashinfer"))
        return next(usable, "torch")
    if name in _CUDA_PREFERENCE and not _installed(name):
        raise ValueError(f"attention_backend '{name}' needs the '{name}' package installed")
    return name


def create_backend(name: str, cfg: AttentionConfig) -> AttentionBackend:
    module_name, class_name = _REGISTRY[resolve_backend_name(name, cfg.device, cfg.dtype)]
    backend: AttentionBackend = getattr(importlib.import_module(module_name), class_name)(cfg)
    return backend


__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionConfig",
    "create_backend",
    "resolve_backend_name",
]
