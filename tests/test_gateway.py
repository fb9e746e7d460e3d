"""`python -m minisgl.server --dp 2`: two replicas behind the SGLang Model Gateway (cache_aware).

Through the gateway: /v1/models names the model and its tokenizer registers (from our
/server_info and /model_info); two groups of requests sharing a long system prompt hit the
prefix cache as often as on one replica; a replica that is killed leaves every later request
answered by the other."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minisgl.runtime.gateway import gateway_installed
from tests.dp_utils import FAST_HEALTH_CHECKS, DataParallelProcess, prompt_tokens_served, start_dp

pytestmark = pytest.mark.skipif(
    not gateway_installed(), reason="sglang-router is not installed (pip install sglang-router)"
)

HTTP_TIMEOUT_S = 120.0
WAIT_S = 30.0
POLL_S = 0.1
NUM_GROUPS = 2
GROUP_SIZE = 6
SYSTEM_PROMPT_WORDS = 250  # ~300 tokens: "long" next to the user turn
WORDS = "sea sky stone river cloud field light wind snow hill leaf rain".split()
# Token counts of two runs differ by a few chat-template tokens shared across groups (reused
# only when both groups land on one replica); a request routed away from its prefix would
# lose ~300 cached tokens, 6% of the total.
HIT_RATE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def launch(tiny_qwen3) -> Iterator[DataParallelProcess]:
    dp = start_dp(tiny_qwen3, 2, "--router-args", FAST_HEALTH_CHECKS)
    try:
        dp.wait_ready()
        yield dp
    finally:
        dp.stop()
        dp.log_path.unlink(missing_ok=True)


def _chat(url: str, model: str, system: str, question: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def _run_groups(url: str, model: str, tag: str) -> tuple[int, int]:
    """2 groups x 6 requests, each group one shared system prompt (differing from the first
    word on). The first request of each group, both at once; then the other 5 of each, all
    at once: each finds its group's prefix cached, if it reaches the replica that holds it.
    Returns (prompt tokens, cached prompt tokens)."""
    systems = []
    for group in range(NUM_GROUPS):
        rng = random.Random(f"{tag}-{group}")
        words = " ".join(rng.choice(WORDS) for _ in range(SYSTEM_PROMPT_WORDS))
        systems.append(f"{tag}{group}: {words}")
    phases = [
        [(system, "question 0?") for system in systems],
        [(system, f"question {i}?") for system in systems for i in range(1, GROUP_SIZE)],
    ]
    usages = []
    with ThreadPoolExecutor(NUM_GROUPS * GROUP_SIZE) as pool:
        for phase in phases:
            replies = pool.map(lambda sq: _chat(url, model, *sq), phase)
            usages += [reply["usage"] for reply in replies]
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return prompt, cached


def test_the_gateway_names_the_model_and_registers_its_tokenizer(launch, tiny_qwen3):
    from transformers import AutoTokenizer

    models = httpx.get(launch.url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert [card["id"] for card in models["data"]] == [str(tiny_qwen3)]
    workers = httpx.get(launch.url + "/workers", timeout=HTTP_TIMEOUT_S).json()["workers"]
    assert sorted(w["url"] for w in workers) == [launch.replica_url(i) for i in range(2)]
    for worker in workers:
        assert worker["is_healthy"] and worker["model_id"] == str(tiny_qwen3)
        assert worker["metadata"]["model_path"] == str(tiny_qwen3.resolve())
        assert worker["metadata"]["model_type"] == "qwen3"
    # The gateway tokenizes with the tokenizer it loaded from our model_path (in the background,
    # after it registered the workers).
    text = "The sea is calm tonight."
    body = {"model": str(tiny_qwen3), "prompt": text}
    deadline_s = time.monotonic() + WAIT_S
    while True:
        tokenized = httpx.post(launch.url + "/v1/tokenize", json=body, timeout=HTTP_TIMEOUT_S)
        if tokenized.status_code == 200 or time.monotonic() > deadline_s:
            break
        time.sleep(POLL_S)
    assert tokenized.status_code == 200, tokenized.text
    expected = AutoTokenizer.from_pretrained(tiny_qwen3).encode(text, add_special_tokens=False)
    assert tokenized.json()["tokens"] == expected
    assert "Failed to load tokenizer" not in launch.log()


def test_shared_prefix_groups_hit_the_cache_as_on_one_replica(launch, tiny_qwen3):
    model = str(tiny_qwen3)
    prompt_gw, cached_gw = _run_groups(launch.url, model, "gateway")
    # The same workload (other prompts, same shape) sent to one replica directly.
    prompt_one, cached_one = _run_groups(launch.replica_url(0), model, "single")
    assert prompt_gw == prompt_one  # same shape
    assert cached_one / prompt_one > 0.6  # the baseline does reuse the prefixes
    assert cached_gw / prompt_gw >= cached_one / prompt_one - HIT_RATE_TOLERANCE, (
        cached_gw,
        cached_one,
        prompt_one,
    )


def _healthy_urls(launch: DataParallelProcess) -> set[str]:
    workers = httpx.get(launch.url + "/workers", timeout=HTTP_TIMEOUT_S).json()["workers"]
    return {w["url"] for w in workers if w["is_healthy"]}


def test_native_generate_and_flush_cache_through_the_gateway(launch, tiny_qwen3):
    """SGLang clients talk to the gateway's /generate; /flush_cache reaches every replica."""
    body = {
        "input_ids": list(range(100, 160)),
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(launch.url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    out = response.json()
    assert len(out["output_ids"]) == 3 and out["meta_info"]["completion_tokens"] == 3
    direct = httpx.post(launch.replica_url(0) + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert direct.json()["output_ids"] == out["output_ids"]
    flushed = httpx.post(launch.url + "/flush_cache", timeout=HTTP_TIMEOUT_S)
    assert flushed.status_code == 200, flushed.text
    for i in range(2):
        again = httpx.post(launch.replica_url(i) + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
        assert again.json()["meta_info"]["cached_tokens"] == 0, i


def test_a_killed_replica_loses_no_later_request(launch, tiny_qwen3):
    urls = [launch.replica_url(i) for i in range(2)]
    served = [prompt_tokens_served(url) for url in urls]
    victim = served.index(max(served))  # the one holding the cached prefixes
    survivor = urls[1 - victim]
    launch.child(f"sched{victim}").kill()
    deadline_s = time.monotonic() + WAIT_S
    while urls[victim] in _healthy_urls(launch):  # the launcher or the health check takes it out
        assert time.monotonic() < deadline_s, launch.log()
        time.sleep(POLL_S)
    assert f"replica {victim} ({urls[victim]}): sched{victim} exited unexpectedly" in launch.log()
    before = prompt_tokens_served(survivor)
    # Every request from now on is answered, by the survivor.
    prompt, _ = _run_groups(launch.url, str(tiny_qwen3), "after")
    deadline_s = time.monotonic() + WAIT_S  # its counters are published every 50 ms
    while prompt_tokens_served(survivor) < before + prompt and time.monotonic() < deadline_s:
        time.sleep(POLL_S)
    assert prompt_tokens_served(survivor) == before + prompt
    assert launch.proc.poll() is None
    assert launch.stop() == 0
    assert launch.leftovers == []
    assert "Traceback" not in launch.log()
