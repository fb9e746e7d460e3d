"""Attention backends by name, imported lazily so optional GPU packages stay optional."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from minisgl.attention.base import AttentionBackend, AttentionBatch

# name -> "module:Class"
_REGISTRY = {
    "torch": "minisgl.attention.torch_native:TorchNativeBackend",
    "flashinfer": "minisgl.attention.flashinfer:FlashInferBackend",
}


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "torch"
        if (
            device.type == "cuda"
            and importlib.util.find_spec("flashinfer") is not None
            and importlib.util.find_spec("minisgl.attention.flashinfer") is not None
        ):
            name = "flashinfer"
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend: unknown '{name}' (choose from {', '.join(_REGISTRY)})"
        )
    module_name, class_name = _REGISTRY[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls()


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend"]
