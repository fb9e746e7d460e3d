"""fp32 CPU kernels (the C sources in `csrc/`), built at first use (build.py) and called through
ctypes: linear layers on packed panels or GGUF blocks, the elementwise ops, decode attention,
sampling, and a whole decode step in one call (why: RESULTS.md section 10).

The library must pass a numeric self-check against torch before it serves; with no compiler or
a failed build or check, `get()` returns None (logged once) and callers keep their torch path.
`MINISGL_CPU_KERNELS=0` turns the kernels off. They run on torch's OpenMP pool and thread count."""

import functools
import logging

import torch

from minisgl.config import env_switch
from minisgl.kernels import build, cpu_abi
from minisgl.kernels.cpu_ops import CpuKernels

logger = logging.getLogger(__name__)

ENABLE_ENV = "MINISGL_CPU_KERNELS"  # "0" turns the kernels off
INT8_ENV = "MINISGL_INT8_ACTIVATIONS"  # "1": GGUF blocks times int8 activations (csrc/quant_int8.c)
SELF_CHECK_ATOL = 1e-4


def _self_check(kernels: CpuKernels) -> None:
    """A miscompiled or mismatched library must never serve: compare with torch once."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * kernels.block_n + 5, 37, generator=gen)
    bias = torch.randn(weight.shape[0], generator=gen)
    x = torch.randn(13, 37, generator=gen)
    got = kernels.linear(x, kernels.pack(weight), bias)
    want = torch.nn.functional.linear(x, weight, bias)
    if not torch.allclose(got, want, atol=SELF_CHECK_ATOL, rtol=SELF_CHECK_ATOL):
        raise RuntimeError(f"self-check failed: linear differs by {(got - want).abs().max():.3g}")
    gate_up = torch.randn(3, 2 * 41, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    if not torch.allclose(kernels.silu_mul(gate_up), want, atol=SELF_CHECK_ATOL):
        raise RuntimeError("self-check failed: silu_mul differs")


@functools.cache
def get() -> CpuKernels | None:
    """The kernels, or None when they are turned off or cannot be built here (logged once)."""
    if env_switch(ENABLE_ENV) is False:
        logger.info("CPU kernels off (%s=0): torch ops only", ENABLE_ENV)
        return None
    try:
        kernels = CpuKernels(cpu_abi.load(build.build_library()))
        _self_check(kernels)
        if env_switch(INT8_ENV):
            on = kernels.set_int8_activations(True)
            logger.info("int8 activations for GGUF blocks: %s", on or "no AVX2")
    except Exception as exc:  # noqa: BLE001 (any failure means: fall back to torch)
        logger.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return None
    return kernels


def kernels_for(device: torch.device, dtype: torch.dtype) -> CpuKernels | None:
    """The kernels for work in `dtype` on `device` when they apply (fp32 on the CPU), else None."""
    return get() if device.type == "cpu" and dtype == torch.float32 else None
