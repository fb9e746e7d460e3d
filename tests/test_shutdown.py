"""Graceful shutdown: SIGTERM stops new work (503) but lets open requests finish, then exits 0.

(An open request that outlives --shutdown-timeout ends as aborted: test_server's
test_sigterm_stops_everything. Fail-fast when the scheduler dies: test_load.)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from minisgl.runtime.supervisor import describe_exit
from tests.server_utils import alive, start_server

NUM_STREAMS = 8
# Long enough that the streams are still running while the test checks the 503s (the tiny
# model decodes fast on the CPU kernels: 200 tokens can be over in a fraction of a second).
MAX_TOKENS = 480  # 8 x 483 tokens fit the test server's 4096-token KV pool
SHUTDOWN_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 180.0


def test_describe_exit():
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(None) == "exit code unknown"


def test_sigterm_drains_open_streams(tiny_qwen3):
    srv = start_server("--model", str(tiny_qwen3), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        srv.wait_healthy()
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        started = threading.Barrier(NUM_STREAMS + 1, timeout=HTTP_TIMEOUT_S)
        body = {
            "prompt": [1, 2, 3],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        def stream(i: int) -> list[str]:
            url = srv.url + "/v1/completions"
            with httpx.stream("POST", url, json=body | {"seed": i}, timeout=HTTP_TIMEOUT_S) as r:
                lines = r.iter_lines()
                first = next(lines)
                started.wait()  # every stream is running before SIGTERM
                return [first, *lines]

        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            streams = [pool.submit(stream, i) for i in range(NUM_STREAMS)]
            started.wait()
            sigterm_s = time.monotonic()
            os.kill(srv.proc.pid, signal.SIGTERM)
            # Draining: /health and new requests get 503 while the streams go on.
            deadline_s = sigterm_s + HTTP_TIMEOUT_S
            while httpx.get(srv.url + "/health", timeout=10.0).status_code != 503:
                assert time.monotonic() < deadline_s
                time.sleep(0.02)
            refused = httpx.post(
                srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10.0
            )
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["message"] == "The server is shutting down."
            assert not any(s.done() for s in streams), "the streams ended before the checks"
            results = [s.result() for s in streams]

        for lines in results:
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert [f for f in finishes if f] == ["length"]  # finished, not aborted
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert srv.proc.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0
        assert time.monotonic() - sigterm_s < SHUTDOWN_TIMEOUT_S
        deadline_s = time.monotonic() + 10.0
        while any(alive(p) for p in children) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert not [p for p in children if alive(p)]
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
