"""When the layers and the sampler use the fused Triton kernels (minisgl/kernels/
triton_fused.py: norms, rope, activation, KV store; triton_sampling.py: temperature sampling).

`MINISGL_FUSED_KERNELS`:
- unset or `auto`: for CUDA tensors, when Triton imports (it ships with torch's Linux CUDA
  wheels); CPU tensors keep the CPU kernels or torch ops;
- `0`: never (torch ops everywhere: the A/B knob for benchmarks and debugging);
- `1`: for CPU tensors too, which only works under Triton's interpreter (TRITON_INTERPRET=1):
  how tests run a whole model through the kernels without a GPU.

Read once per process (`fused_kernels_for` sits on every layer's path); `reset()` re-reads it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENABLE_ENV = "MINISGL_FUSED_KERNELS"
_OFF = ("0", "false", "off", "no")
_FORCE = ("1", "true", "on", "yes")


@functools.cache
def _mode() -> str:
    value = os.environ.get(ENABLE_ENV, "auto").strip().lower()
    if value in _OFF:
        logger.info("fused GPU kernels off (%s=0): torch ops only", ENABLE_ENV)
        return "off"
    return "force" if value in _FORCE else "auto"


@functools.cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"minisgl.kernels.{name}")
    except ImportError as exc:  # no triton here: torch ops do the same work, slower
        logger.warning("fused GPU kernels unavailable (%s): torch ops only", exc)
        return None


def _applies_to(x: torch.Tensor) -> bool:
    mode = _mode()
    return mode == "force" or (mode == "auto" and x.is_cuda)


def fused_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The fused layer kernels module (triton_fused) when it applies to tensors like x."""
    return _module("triton_fused") if _applies_to(x) else None


def sampling_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The sampling kernel module (triton_sampling) when it applies to tensors like x."""
    return _module("triton_sampling") if _applies_to(x) else None


def reset() -> None:
    """Forget the cached setting (tests change the variable)."""
    _mode.cache_clear()
