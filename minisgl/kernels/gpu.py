"""Which kernels a layer or the sampler calls: the Triton ones (triton_fused.py, triton_sampling.py,
triton_fp8.py), the C ones (cpu.py), or none (torch ops), chosen when the layer is built.

`MINISGL_FUSED_KERNELS` (read once; `reset()` re-reads it): unset or `auto`, Triton on CUDA when
it imports; `0`, never (the A/B knob); `1`, on the CPU too, which only works under Triton's
interpreter (TRITON_INTERPRET=1: how tests run a whole model through them)."""

import functools
import importlib
import logging
from types import ModuleType

import torch

from minisgl.config import env_switch
from minisgl.kernels import cpu
from minisgl.kernels.cpu_ops import CpuKernels

logger = logging.getLogger(__name__)

ENABLE_ENV = "MINISGL_FUSED_KERNELS"


@functools.cache
def _mode() -> bool | None:
    """False: off; True: on every device; None: auto."""
    mode = env_switch(ENABLE_ENV)
    if mode is False:
        logger.info("fused GPU kernels off (%s=0): torch ops only", ENABLE_ENV)
    return mode


@functools.cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"minisgl.kernels.{name}")
    except ImportError as exc:  # no triton here: torch ops do the same work, slower
        logger.warning("fused GPU kernels unavailable (%s): torch ops only", exc)
        return None


def triton_kernels(name: str, device: torch.device) -> ModuleType | None:
    """The Triton kernel module `name` ("triton_fused": the layers', "triton_sampling": the
    sampler's) when it applies on `device`."""
    mode = _mode()
    return _module(name) if mode or (mode is None and device.type == "cuda") else None


def fp8_linear_kernels(device: torch.device) -> ModuleType | None:
    """minisgl/kernels/triton_fp8.py where an FP8 checkpoint's weights stay fp8: FP8 tensor
    cores (compute capability 8.9+: Ada, Hopper and newer), or the CPU under the interpreter."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return None
    return triton_kernels("triton_fp8", device)


def layer_kernels(
    device: torch.device | None = None, dtype: torch.dtype | None = None
) -> ModuleType | CpuKernels | None:
    """The kernels of a layer computing in `dtype` on `device`: the Triton ones (triton_fused)
    where they apply, else the C kernels, else None (torch ops). Both kinds have the same
    `rmsnorm`, `silu_mul` and `store_kv`. By default: where a layer built now puts its
    parameters (torch's default device and dtype: the engine builds the model under its own)."""
    device = torch.get_default_device() if device is None else device
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return triton_kernels("triton_fused", device) or cpu.kernels_for(device, dtype)


def reset() -> None:
    """Forget the cached setting (tests change the variable)."""
    _mode.cache_clear()
