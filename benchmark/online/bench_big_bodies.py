"""Big JSON bodies beside a streaming "canary" (issue 45, item 2): for each body, the time to its
answer, the canary's largest gap between chunks while it ran, and the API process's peak RSS
growth. The canary's quiet gap is measured first, for scale.

  python benchmark/online/bench_big_bodies.py [--port 8123] [--model PATH] [--repeats 2]

Starts `python -m minisgl.server` with the bundled model (default flags) unless --model is given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from typing import Any

import httpx
import psutil
from bench_common import COMPLETIONS_PATH, LocalServer

MIB = 1 << 20
REQUEST_TIMEOUT_S = 600.0
QUIET_S = 3.0  # the canary alone, before the first body
SAMPLE_S = 0.02
CANARY_MAX_TOKENS = 4000  # one stream's length: the canary starts another after it
API_PROCESS_NAME = "minisgl:api"


def ids_body(num_ids: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": [1] * num_ids, "max_tokens": 1, **extra}


# name -> (path, body); json.dumps's default ", " separator: 10M ids make the 28.6 MiB.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "10M ids, /v1/completions": (COMPLETIONS_PATH, ids_body(10_000_000)),
    "3M ids, /v1/completions": (COMPLETIONS_PATH, ids_body(3_000_000)),
    "10M ids, /detokenize": ("/detokenize", {"tokens": [1] * 10_000_000}),
    "1M ids, /detokenize (legitimate)": ("/detokenize", {"tokens": [1] * (1 << 20)}),
}


class Canary(threading.Thread):
    """A long greedy stream; `times_s` when each chunk arrived."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.times_s, self.stop = url, [], threading.Event()

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": CANARY_MAX_TOKENS, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        while not self.stop.is_set():
            with httpx.stream(
                "POST", self.url + COMPLETIONS_PATH, json=body, timeout=120
            ) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: {"):
                        self.times_s.append(time.monotonic())
                    if self.stop.is_set():
                        return

    def max_gap_s(self, start_s: float, end_s: float) -> float:
        pairs = itertools.pairwise(self.times_s)
        return max((b - a for a, b in pairs if b >= start_s and a <= end_s), default=0.0)


class PeakRss(threading.Thread):
    def __init__(self, process: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.process, self.peak_bytes, self.stop = process, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)


def measure(url: str, api: psutil.Process, canary: Canary, path: str, raw: bytes) -> str:
    before_bytes = api.memory_info().rss
    sampler = PeakRss(api)
    sampler.start()
    start_s = time.monotonic()
    headers = {"Content-Type": "application/json"}
    response = httpx.post(url + path, content=raw, headers=headers, timeout=REQUEST_TIMEOUT_S)
    end_s = time.monotonic()
    time.sleep(0.5)  # the canary's next chunk closes the last gap
    sampler.stop.set()
    sampler.join()
    error = response.json().get("error", {}) if response.status_code != 200 else {}
    return (
        f"{response.status_code} {error.get('param')!s:8} in {end_s - start_s:6.2f} s, "
        f"canary gap {canary.max_gap_s(start_s, end_s):6.2f} s, "
        f"RSS +{max(0, sampler.peak_bytes - before_bytes) // MIB} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    server = LocalServer(args.model, args.port, [])
    try:
        root = psutil.Process(server.proc.pid)
        api = next(p for p in root.children(recursive=True) if p.name() == API_PROCESS_NAME)
        canary = Canary(server.url)
        canary.start()
        time.sleep(QUIET_S)
        print(f"quiet canary gap {canary.max_gap_s(0, time.monotonic()):.2f} s")
        raws = {name: json.dumps(body).encode() for name, (_, body) in CASES.items()}
        for _, (name, (path, _)) in itertools.product(range(args.repeats), CASES.items()):
            figures = measure(server.url, api, canary, path, raws[name])
            print(f"{name:34} {len(raws[name]) / MIB:5.1f} MiB: {figures}", flush=True)
        canary.stop.set()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
