"""Which share of the machine each `--dp` replica gets: its own `--tp` GPUs on CUDA
(CUDA_VISIBLE_DEVICES), its own cores on CPU (CPU affinity, by which torch sizes its thread pool
and tp its ranks: minisgl.scheduler.tp_ranks.cpu_threads_per_rank)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from minisgl.config import ServerArgs
from minisgl.supervisor import StartupError

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    """The share of the machine one replica sees."""

    cuda_visible_devices: str | None = None  # None: CPU, or leave the GPUs as they are
    cpus: frozenset[int] | None = None  # None: every core the launcher may use

    def describe(self) -> str:
        if self.cuda_visible_devices is not None:
            return f"GPUs {self.cuda_visible_devices}"
        if self.cpus is not None:
            return f"cores {','.join(map(str, sorted(self.cpus)))}"
        return "every core"

    @contextlib.contextmanager
    def for_new_processes(self) -> Iterator[None]:
        """Processes started inside get this placement: a process gets a copy of its parent's
        environment and CPU affinity when it starts. This process gets its own back after."""
        saved_env = os.environ.get(CUDA_VISIBLE_DEVICES)
        saved_cpus = os.sched_getaffinity(0) if self.cpus is not None else None
        try:
            if self.cuda_visible_devices is not None:
                os.environ[CUDA_VISIBLE_DEVICES] = self.cuda_visible_devices
            if self.cpus is not None:
                os.sched_setaffinity(0, self.cpus)
            yield
        finally:
            if saved_env is None:
                os.environ.pop(CUDA_VISIBLE_DEVICES, None)
            else:
                os.environ[CUDA_VISIBLE_DEVICES] = saved_env
            if saved_cpus is not None:
                os.sched_setaffinity(0, saved_cpus)


def _visible_gpus(args: ServerArgs) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    if args.device == "cpu":
        return []
    import torch  # only here: the launcher stays light otherwise

    count = torch.cuda.device_count()
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    if visible is not None:
        return [dev.strip() for dev in visible.split(",") if dev.strip()][:count]
    return [str(i) for i in range(count)]


def plan_placements(args: ServerArgs, dp_size: int) -> list[Placement]:
    """GPUs when there are any: replica i gets the i-th group of --tp of them. Otherwise the cores
    are split into dp_size contiguous groups (shared round-robin if there are fewer cores)."""
    gpus = _visible_gpus(args)
    if gpus:
        per_replica = args.tp_size
        if len(gpus) < dp_size * per_replica:
            raise StartupError(
                f"--dp {dp_size} --tp {per_replica} needs {dp_size * per_replica} GPUs; "
                f"{len(gpus)} visible"
            )
        groups = [gpus[i * per_replica : (i + 1) * per_replica] for i in range(dp_size)]
        return [Placement(cuda_visible_devices=",".join(group)) for group in groups]
    if not hasattr(os, "sched_getaffinity"):  # no CPU affinity here (macOS): share every core
        return [Placement() for _ in range(dp_size)]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < dp_size:
        return [Placement(cpus=frozenset({cpus[i % len(cpus)]})) for i in range(dp_size)]
    bounds = [len(cpus) * i // dp_size for i in range(dp_size + 1)]
    return [Placement(cpus=frozenset(cpus[bounds[i] : bounds[i + 1]])) for i in range(dp_size)]
