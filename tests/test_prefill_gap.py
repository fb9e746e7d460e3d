"""A long prompt does not stall the streams already decoding (issue 45, item 3): on a real server
(the bundled SmolLM2, the test servers' 1024-token context), a canary streams while a prompt of
nearly the whole context prefills. With chunks of --max-prefill-tokens alone that prompt was one
chunk of several seconds; sized to --target-itl-ms's default, each step stays near two of the
canary's quiet gaps. The margin is for a loaded 2-core machine; benchmark/online/
bench_prefill_gap.py measures the gaps on a quiet one."""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time

import httpx
import pytest

from tests.server_utils import ServerProcess

REQUEST_TIMEOUT_S = 300.0
LONG_PROMPT_LEN = 1000  # of the test servers' 1024
CANARY_MAX_TOKENS = 1000  # more than it streams before the test stops it
QUIET_CHUNKS = 20
# The bound is 2x the quiet median + 250 ms on a quiet machine; here other work may
# stall any step, so the bound is wider, yet far below one chunk of the whole prompt.
GAP_FACTOR, GAP_EXTRA_S = 3.0, 1.0
POLL_S = 0.05


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server


def _body(ids: list[int], max_tokens: int, stream: bool) -> dict:
    return {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


class _Canary(threading.Thread):
    """A stream that records when each chunk arrives, until told to stop."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.url = server.url + "/v1/completions"
        self.times_s: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = _body([1000 + i for i in range(16)], CANARY_MAX_TOKENS, stream=True)
        try:
            with httpx.stream("POST", self.url, json=body, timeout=REQUEST_TIMEOUT_S) as stream:
                for line in stream.iter_lines():  # ends with the stream: at most max_tokens
                    if line.startswith("data: {"):
                        self.times_s.append(time.monotonic())
                    if self.stop.is_set():
                        return
        except BaseException as exc:  # reported by the test
            self.error = exc


def _wait_chunks(canary: _Canary, count: int) -> None:
    deadline_s = time.monotonic() + REQUEST_TIMEOUT_S
    while len(canary.times_s) < count and canary.is_alive() and time.monotonic() < deadline_s:
        time.sleep(POLL_S)
    assert len(canary.times_s) >= count, canary.error


def test_a_long_prompt_keeps_other_streams_flowing(server: ServerProcess) -> None:
    canary = _Canary(server)
    canary.start()
    try:
        _wait_chunks(canary, QUIET_CHUNKS)
        quiet_s = statistics.median(b - a for a, b in itertools.pairwise(canary.times_s))
        rng = random.Random(0)
        ids = [rng.randrange(1000, 20000) for _ in range(LONG_PROMPT_LEN)]
        start_s = time.monotonic()
        response = httpx.post(
            server.url + "/v1/completions", json=_body(ids, 1, False), timeout=REQUEST_TIMEOUT_S
        )
        end_s = time.monotonic()
        assert response.status_code == 200, response.text
        _wait_chunks(canary, len(canary.times_s) + 1)  # the gap that spans the answer
    finally:
        canary.stop.set()
        canary.join(REQUEST_TIMEOUT_S)
    assert canary.error is None, canary.error
    times_s = canary.times_s
    during = [b - a for a, b in itertools.pairwise(times_s) if b >= start_s and a <= end_s]
    print(f"quiet gap {quiet_s:.3f} s, prefill {end_s - start_s:.1f} s, max gap {max(during):.3f}")
    assert max(during) < GAP_FACTOR * quiet_s + GAP_EXTRA_S, during
