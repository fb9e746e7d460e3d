"""Attention backends by name, imported lazily so optional GPU packages stay optional.

A CUDA backend (FlashInfer) registers here as "flashinfer" once it exists; "auto" will prefer it
on CUDA when the package is installed. Today every device runs the torch-native backend.
"""

from __future__ import annotations

import importlib

import torch

from minisgl.attention.base import AttentionBackend, AttentionBatch

# name -> "module:Class", imported on first use
_REGISTRY = {
    "torch": "minisgl.attention.torch_native:TorchNativeBackend",
}


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "torch"  # the only backend today, on every device
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend: unknown '{name}' (choose from auto, {', '.join(_REGISTRY)})"
        )
    module_name, class_name = _REGISTRY[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls()


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend"]
