"""GPU utilisation and memory for /metrics, read in the scheduler process (CUDA only).

torch is imported inside the functions: the scheduler process has it loaded already, and nothing
here runs on CPU. Utilisation comes from NVML through `torch.cuda.utilization` and needs the
`nvidia-ml-py` package (pulled in by CUDA builds of torch); without it only memory is reported.
"""

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# NVML's own sample period is 1/6 s to 1 s: reading it more often only costs time.
GPU_SAMPLE_INTERVAL_S = 1.0
PERCENT = 100.0


@dataclass(frozen=True)
class GpuSample:
    """Named as the SchedulerStats fields it fills in (minisgl.stats)."""

    gpu_utilization_ratio: float | None  # None: NVML unavailable
    gpu_memory_used_bytes: int  # the whole device's, as nvidia-smi shows it (all processes)
    gpu_memory_total_bytes: int


class GpuProbe:
    """Samples one CUDA device at most once per GPU_SAMPLE_INTERVAL_S."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._last: GpuSample | None = None
        self._last_time_s = float("-inf")
        self._utilization_ok = True

    def sample(self, now_s: float) -> GpuSample | None:
        if now_s - self._last_time_s < GPU_SAMPLE_INTERVAL_S:
            return self._last
        self._last_time_s = now_s
        import torch

        try:
            free_bytes, total_bytes = torch.cuda.mem_get_info(self.device_index)
        except RuntimeError as exc:
            logger.warning("gpu metrics: cannot read device memory: %s", exc)
            return None
        utilization: float | None = None
        if self._utilization_ok:
            try:
                utilization = torch.cuda.utilization(self.device_index) / PERCENT
            # No nvidia-ml-py (ImportError), or an NVML error, whose class lives in pynvml.
            except Exception as exc:
                logger.info("gpu metrics: no utilisation (%s); memory only", exc)
                self._utilization_ok = False
        self._last = GpuSample(utilization, total_bytes - free_bytes, total_bytes)
        return self._last


def make_gpu_probe(device_type: str, device_index: int | None) -> GpuProbe | None:
    """A probe for a CUDA device; None for any other device (nothing to report)."""
    return GpuProbe(device_index or 0) if device_type == "cuda" else None
