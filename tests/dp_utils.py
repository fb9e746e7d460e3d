"""Start and stop a real `python -m minisgl.server --dp N` for tests; find its replicas."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.server_utils import (
    POLL_INTERVAL_S,
    SHUTDOWN_TIMEOUT_S,
    TEST_SERVER_FLAGS,
    LocalEndpoint,
    alive,
    free_port_block,
)

STARTUP_TIMEOUT_S = 240.0
LEFTOVER_GRACE_S = 5.0
READY_LINE = "minisgl serving"
# The gateway probes every second and gives up on a replica at the first failure: a dead one
# leaves rotation within ~2 s.
FAST_HEALTH_CHECKS = (
    "--health-check-interval-secs 1 --health-failure-threshold 1 --health-check-timeout-secs 2"
)


@dataclass
class DataParallelProcess(LocalEndpoint):
    proc: subprocess.Popen
    port: int  # the gateway's (replicas on port+1 ...)
    dp_size: int
    log_path: Path
    api_key: str | None = None
    leftovers: list[psutil.Process] = field(default_factory=list)  # alive after stop()

    def replica_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + index}"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        while READY_LINE not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline_s:
                self.stop()
                raise TimeoutError(f"--dp not ready after {timeout_s} s:\n{self.log()}")
            time.sleep(POLL_INTERVAL_S)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child(self, name: str) -> psutil.Process:
        """A process of the launch by its name: sched0, api1, ... (shown as minisgl:<name>)."""
        for process in self.descendants():
            if process.name() == f"minisgl:{name}":
                return process
        raise LookupError(f"no process minisgl:{name} among {self.descendants()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop the launcher; whatever is left of its processes afterwards is killed (and the
        caller can check that nothing was)."""
        processes = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        # Helpers such as multiprocessing's resource tracker exit when they see the launcher go.
        deadline_s = time.monotonic() + LEFTOVER_GRACE_S
        while any(alive(p) for p in processes) and time.monotonic() < deadline_s:
            time.sleep(POLL_INTERVAL_S)
        self.leftovers = [p for p in processes if alive(p)]
        for process in self.leftovers:
            process.kill()
        return int(self.proc.returncode)


def start_dp(
    model: Path, dp_size: int, *extra_args: str, api_key: str | None = None
) -> DataParallelProcess:
    port = free_port_block(dp_size + 2)  # gateway, replicas, gateway metrics
    fd, log_name = tempfile.mkstemp(prefix="minisgl-dp-", suffix=".log")
    args = [
        *(sys.executable, "-m", "minisgl.server", "--model", str(model)),
        *("--port", str(port), "--dp", str(dp_size), *TEST_SERVER_FLAGS),
    ]
    if api_key:
        args += ["--api-key", api_key]
    with os.fdopen(fd, "wb") as log_file:
        proc = subprocess.Popen(
            [*args, *extra_args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return DataParallelProcess(proc, port, dp_size, Path(log_name), api_key)


def prompt_tokens_served(url: str) -> float:
    """A replica's prompt-token counter (its own /metrics): which replica served what."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("minisgl:prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError(f"no prompt token counter in {url}/metrics")
