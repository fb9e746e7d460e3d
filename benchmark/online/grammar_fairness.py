"""Grammar compiles beside a streaming canary (issue 45, items 1 and 4), on a server it starts.

1. The first constrained request after start: its latency, and the canary's largest gap
   between chunks while it runs (the scheduler used to build its compiler inside a step).
2. Six requests of one tenant (`user: attacker`), each a ~200 KB regex that runs into the
   compile timeout; 2 s later a trivial regex and a malformed one from other tenants: their
   latencies, and the canary's largest gap meanwhile.

    python benchmark/online/grammar_fairness.py [--repo DIR] [-- SERVER FLAGS...]

`--repo`: the checkout whose `python -m minisgl.server` runs (another commit's, for a before).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import socket
import string
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0
NUM_ATTACKERS = 6
ATTACK_HEAD_START_S = 2.0
ALTERNATIVES = 22_000  # 8-letter words: ~200 KB, seconds to compile on 2 cores
TRIVIAL_REGEX = "[0-9]{3}-v"
MALFORMED_REGEX = "([0-9]{3}"
CANARY_TOKENS = 4000  # streams through each phase (SmolLM2's context: 8192)


def slow_regex(seed: int) -> str:
    rng = random.Random(seed)
    words = ("".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(ALTERNATIVES))
    return "(" + "|".join(words) + ")"


class Canary(threading.Thread):
    """A long stream; `max_gap_s(a, b)`: its largest gap between chunks around [a, b]."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.times_s, self.started = url, [time.monotonic()], threading.Event()

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": CANARY_TOKENS, "ignore_eos": True}
        url, body = self.url + "/v1/completions", {**body, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    self.times_s.append(time.monotonic())
                    self.started.set()

    def max_gap_s(self, start_s: float, end_s: float) -> float:
        times_s = list(self.times_s)
        gaps = [b - a for a, b in itertools.pairwise(times_s) if b >= start_s and a <= end_s]
        return max([*gaps, end_s - times_s[-1]])


def timed(url: str, regex: str, user: str) -> tuple[float, int]:
    body = {"prompt": "Code:", "max_tokens": 8, "temperature": 0, "regex": regex, "user": user}
    start_s = time.monotonic()
    response = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    return time.monotonic() - start_s, response.status_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=".")
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.repo)}
    command = [sys.executable, "-m", "minisgl.server", "--port", str(port), *args.server_flags]
    server = subprocess.Popen(command, cwd=args.repo, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline_s:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        canary = Canary(url)
        canary.start()
        canary.started.wait(REQUEST_TIMEOUT_S)
        time.sleep(1.0)  # a quiet stretch first
        quiet_s = canary.max_gap_s(time.monotonic() - 1.0, time.monotonic())
        print(f"canary's largest gap, quiet: {quiet_s:.3f} s")
        start_s = time.monotonic()
        latency_s, status = timed(url, "[a-z]{3}", "first")
        gap_s = canary.max_gap_s(start_s, time.monotonic())
        print(f"first constrained request: {status} in {latency_s:.2f} s, canary gap {gap_s:.3f} s")
        canary = Canary(url)
        canary.start()
        canary.started.wait(REQUEST_TIMEOUT_S)
        with ThreadPoolExecutor(NUM_ATTACKERS + 2) as pool:
            start_s = time.monotonic()
            attacks = [
                pool.submit(timed, url, slow_regex(i), "attacker") for i in range(NUM_ATTACKERS)
            ]
            time.sleep(ATTACK_HEAD_START_S)
            trivial = pool.submit(timed, url, TRIVIAL_REGEX, "victim")
            malformed = pool.submit(timed, url, MALFORMED_REGEX, "victim-2")
            for name, future in (("trivial", trivial), ("malformed", malformed)):
                latency_s, status = future.result()
                print(f"{name} regex beside the attack: {status} in {latency_s:.2f} s")
            results = [attack.result() for attack in attacks]
            gap_s = canary.max_gap_s(start_s, time.monotonic())
        print(f"attackers: {sorted((status, round(s, 1)) for s, status in results)}")
        print(f"canary's largest gap during the attack: {gap_s:.3f} s")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
