"""What the engine needs from the device beyond tensors: a stream, events, host staging, NVTX.

On CPU every piece is a no-op or a plain copy, so the scheduler and the engine have one code
path; nothing CUDA-only runs at import time. Host values reach the device staged
(`minisgl.attention.base.stage`), so the scheduler never stalls behind the batch in flight."""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from minisgl.attention.base import stage


class ComputeStream:
    """The engine's compute stream on its device, and the host<->device copies around it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        # The forward runs on its own stream, so the scheduler thread never queues work behind
        # it on the default stream (and a profile shows the engine's work on one lane).
        self.cuda_stream: Any = torch.cuda.Stream(device) if self.is_cuda else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Queue the work done inside on this stream (on CPU: run it, nothing to queue)."""
        if self.cuda_stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.cuda_stream):
            yield

    def follow_default_stream(self) -> None:
        """Order the engine's stream after everything queued so far on the device's default
        stream. Its stream comes from torch's pool, made non-blocking: without this, buffers
        created at start-up (on the default stream) could be read before they are written."""
        if self.cuda_stream is not None:
            self.cuda_stream.wait_stream(torch.cuda.current_stream(self.device))

    def stage(self, dtype: torch.dtype, *values: Sequence[Any] | Tensor) -> list[Tensor]:
        """1-D host values (lists or tensors) on the device as `dtype`, in one non-blocking copy
        queued on the current stream."""
        return stage(self.device, dtype, *values)

    def to_host_async(self, x: Tensor) -> Tensor:
        """Start copying `x` to host memory; read the result only after the event recorded next
        (`record_event`) has passed."""
        if not self.is_cuda:
            return x
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return out.copy_(x, non_blocking=True)

    def record_event(self) -> Any:
        """A torch.cuda.Event at the stream's current point (`synchronize()` blocks the host until
        it passes); None on CPU, where everything has run already."""
        return None if self.cuda_stream is None else self.cuda_stream.record_event()

    def synchronize(self) -> None:
        if self.cuda_stream is not None:
            self.cuda_stream.synchronize()


# Set by benchmark/offline/profile_steps.py on CPU, where ranges are off by default (each costs
# a few microseconds, and nothing but that profiler reads them there).
RANGES_ON_CPU = False


def nvtx_range(name: str, is_cuda: bool) -> contextlib.AbstractContextManager[Any]:
    """An NVTX range on CUDA (Nsight shows schedule / forward / sample / process), also a
    torch.profiler range (benchmark/offline/profile_steps.py sums them); on CPU only the
    profiler range, and only with RANGES_ON_CPU set."""
    if is_cuda:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.nvtx.range(name))
        stack.enter_context(torch.profiler.record_function(name))
        return stack
    return torch.profiler.record_function(name) if RANGES_ON_CPU else contextlib.nullcontext()
