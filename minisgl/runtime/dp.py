"""`python -m minisgl.server --dp N`: N whole servers (replicas, on --port + 1 ...) behind the
SGLang Model Gateway on --port, each on its own GPUs (CUDA_VISIBLE_DEVICES) or cores (CPU
affinity). A replica that dies is stopped and leaves the gateway's rotation; the rest keep
serving. SIGTERM / Ctrl-C stop the gateway first, then every replica at once, each draining.
docs/scaling.md is the reference."""

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import wait

from minisgl.config import DataParallelArgs, ServerArgs
from minisgl.models.names import served_model_name
from minisgl.runtime.gateway import INSTALL_HINT, Gateway, gateway_installed
from minisgl.runtime.launch import CHILD_FAILED_EXIT_CODE, ServerStack, StopRequests
from minisgl.runtime.supervisor import WATCH_INTERVAL_S, StartupError

logger = logging.getLogger("minisgl")

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    """The share of the machine one replica sees."""

    cuda_visible_devices: str | None = None  # None: CPU, or leave the GPUs as they are
    cpus: frozenset[int] | None = None  # None: every core the launcher may use

    def __str__(self) -> str:
        if self.cuda_visible_devices is not None:
            return f"GPUs {self.cuda_visible_devices}"
        return f"cores {sorted(self.cpus)}" if self.cpus is not None else "every core"

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
    if (visible := os.environ.get(CUDA_VISIBLE_DEVICES)) is not None:
        return [dev.strip() for dev in visible.split(",") if dev.strip()][:count]
    return [str(i) for i in range(count)]


def plan_placements(args: ServerArgs, dp_size: int) -> list[Placement]:
    """GPUs when there are any: replica i gets the i-th group of --tp of them. Otherwise the cores
    are split into dp_size contiguous groups (shared round-robin if there are fewer cores)."""
    if gpus := _visible_gpus(args):
        per_replica = args.tp_size
        if len(gpus) < dp_size * per_replica:
            raise StartupError(
                f"--dp {dp_size} --tp {per_replica} needs {dp_size * per_replica} GPUs; "
                f"{len(gpus)} visible"
            )
        return [
            Placement(",".join(gpus[i * per_replica : (i + 1) * per_replica]))
            for i in range(dp_size)
        ]
    if not hasattr(os, "sched_getaffinity"):  # no CPU affinity here (macOS): share every core
        return [Placement() for _ in range(dp_size)]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < dp_size:
        return [Placement(cpus=frozenset({cpus[i % len(cpus)]})) for i in range(dp_size)]
    bounds = [len(cpus) * i // dp_size for i in range(dp_size + 1)]
    return [Placement(cpus=frozenset(cpus[bounds[i] : bounds[i + 1]])) for i in range(dp_size)]


class DataParallelStack(StopRequests):
    """The replicas and the gateway, driven like a ServerStack by `run_until_stopped`."""

    def __init__(self, args: ServerArgs, dp: DataParallelArgs) -> None:
        self.args = args
        self.dp = dp
        self._replicas: list[ServerStack] = []  # the live ones: a replica that dies leaves
        self._gateway: Gateway | None = None

    def request_stop(self) -> None:
        super().request_stop()
        for replica in self._replicas:
            replica.request_stop()

    def start(self) -> None:
        # --nnodes, --dist-init-addr and --device cuda:N with --dp: refused when parsing.
        if self.dp.use_router and not gateway_installed():
            raise StartupError(
                f"--dp {self.dp.dp_size} puts the SGLang Model Gateway in front of the replicas, "
                f"but sglang-router is not installed: {INSTALL_HINT}; or pass --no-router to "
                "start the replicas alone"
            )
        for index, placement in enumerate(plan_placements(self.args, self.dp.dp_size)):
            replica = ServerStack(self.args.replace(port=self.args.port + 1 + index), index)
            self._replicas.append(replica)
            with placement.for_new_processes():
                replica.start()
            logger.info("replica %d: %s on %s", index, replica.url, placement)

    def wait_ready(self) -> None:
        for replica in self._replicas:  # they load in parallel; this only waits for each
            try:
                replica.wait_ready()
            except StartupError as exc:
                raise StartupError(f"replica {replica.replica}: {exc}") from None
        if self.dp.use_router:
            self._gateway = Gateway(self.args, self.dp, [r.url for r in self._replicas])
            self._gateway.start(lambda: self.stop_requested)

    def ready_message(self) -> str:
        replicas = ", ".join(r.url for r in self._replicas)
        name = served_model_name(self.args)
        if self._gateway is None:
            return f"minisgl serving {name}: replicas at {replicas}"
        return (
            f"minisgl serving {name} at {self._gateway.url}: the SGLang Model Gateway "
            f"({self.dp.router_policy}) in front of {replicas}"
        )

    def watch(self) -> int:
        """Until a stop is requested (0), the gateway exits or no replica is left (non-zero).
        A replica that dies is stopped; the others keep serving."""
        while not self.stop_requested:
            sentinels = [s for replica in self._replicas for s in replica.children.sentinels]
            wait(sentinels, timeout=WATCH_INTERVAL_S)
            for replica in list(self._replicas):
                if (failure := replica.children.failure()) is not None:
                    self._lose(replica, failure)
            if not self._replicas:
                logger.error("every replica has exited; shutting down")
                return CHILD_FAILED_EXIT_CODE
            if self._gateway is not None and self._gateway.exit_code is not None:
                logger.error(
                    "the gateway exited unexpectedly (exit code %s); shutting down",
                    self._gateway.exit_code,
                )
                return CHILD_FAILED_EXIT_CODE
        return 0

    def _lose(self, replica: ServerStack, failure: str) -> None:
        self._replicas.remove(replica)
        logger.error(
            "replica %d (%s): %s; stopping it, %d replica(s) keep serving",
            *(replica.replica, replica.url, failure, len(self._replicas)),
        )
        if self._gateway is not None:
            self._gateway.remove_worker(replica.url)
        replica.shutdown(backend_failed=True)

    def shutdown(self, backend_failed: bool = False) -> None:
        """The gateway first, then every replica at once (each drains, bounded); idempotent.
        A second stop request while the gateway drains cuts its wait short."""
        if self._gateway is not None:
            num_stops_seen = self.num_stop_requests
            self._gateway.stop(hurry=lambda: self.num_stop_requests > num_stops_seen)
        if self._replicas:
            with ThreadPoolExecutor(len(self._replicas)) as pool:
                list(pool.map(lambda r: r.shutdown(backend_failed), self._replicas))
        self._replicas.clear()
