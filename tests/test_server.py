"""The OpenAI-compatible server end to end: real processes, the official SDK and httpx.

One server (the bundled SmolLM2-135M-Instruct) is shared by the module; the last test stops it
with SIGTERM. A second server covers --api-key, /health turning 503 and a child dying.

Oracles: HF transformers on the same checkpoint (its tokenizer and chat template for token
counts, its forward for greedy tokens and logprobs, its logits processors for penalties and
min_tokens), OpenAI's documented defaults and penalty formula, and values computed by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
)

from tests.server_utils import (
    ServerProcess,
    alive,
    openai_client,
    require_default_model,
    running_server,
    start_server,
)

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024  # matches TEST_SERVER_FLAGS
PAGE_SIZE = 1  # the server's default --page-size: the radix cache matches token by token
OPENAI_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
REQUEST_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 30.0
NUM_CONCURRENT_CLIENTS = 32
SMALL_KV_POOL_PAGES = 256
TP_SIZE = 3
SHUTDOWN_TIMEOUT_S = 1  # the last test's stream outlives it
LOGPROB_ATOL = 1e-3  # fp32 logprobs against HF's log-softmax (batch shape changes rounding)
USER_MESSAGES = [
    {"role": "user", "content": "Write a short story about a robot who learns to paint."}
]
PROMPT = "The history of the city of Paris began"
# SmolLM2 answers this greedily with 7 tokens and EOS: "The capital of France is Paris."
EOS_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# ... and continues this one greedily with " go" again and again: what penalties change.
REPEAT_PROMPT = "Repeat after me: go go go go go go"


@pytest.fixture(scope="module")
def server():
    require_default_model()
    with running_server("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def hf(default_model_dir: Path):
    """The oracle: transformers' own model on the checkpoint the server serves."""
    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt HF's chat template makes of `messages`, ready for the assistant's reply."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"])


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy continuation of `prompt`, EOS ignored, with each step's log-softmax (the
    whole sequence recomputed each step: a few short steps, no cache API involved)."""
    out: list[int] = []
    steps: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            steps.append(torch.log_softmax(logits, dim=-1))
            out.append(int(steps[-1].argmax()))
    return out, steps


def hf_generate(hf, prompt: list[int], num_tokens: int, **kwargs) -> list[int]:
    """HF generate, greedy, stopping at EOS as the model's generation config says."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula: logit[j] -= frequency * c[j] + presence * (c[j] > 0), with
    c[j] the times token j occurs in the output so far (the prompt does not count)."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        counts = counts[None, : scores.shape[-1]].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def post(server: ServerProcess, path: str, body, **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
    return httpx.post(server.url + path, json=body, **kwargs)


def flush_cache(server: ServerProcess) -> None:
    """SGLang's /flush_cache: the next request finds nothing in the prefix cache."""
    response = httpx.post(server.url + "/flush_cache", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def greedy_chat(client: openai.OpenAI, max_tokens: int = 24, **extra) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=USER_MESSAGES, max_tokens=max_tokens, temperature=0, **extra
    )
    return response.choices[0].message.content or ""


# ---- basics --------------------------------------------------------------------------------


def test_models_health_metrics(server: ServerProcess, client: openai.OpenAI, tokenizer):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["owned_by"] == "minisgl"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    before = server.metrics()
    for name in (
        "minisgl:prompt_tokens_total",
        "minisgl:generation_tokens_total",
        "minisgl:cached_prompt_tokens_total",
        "minisgl:aborted_requests_total",
        "minisgl:num_running_reqs",
        "minisgl:num_queue_reqs",
        "minisgl:kv_cache_usage_ratio",
        "minisgl:time_to_first_token_seconds_count",
        "minisgl:inter_token_latency_seconds_count",
        "minisgl:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    greedy_chat(client, max_tokens=2, extra_body={"ignore_eos": True})
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"minisgl:{name}"] - before[f"minisgl:{name}"]

    # One request of a known prompt and exactly 2 output tokens: the counters grew by that.
    assert grew("prompt_tokens_total") == len(chat_ids(tokenizer, USER_MESSAGES))
    assert grew("generation_tokens_total") == 2
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("e2e_request_latency_seconds_count") == 1
    assert after["minisgl:num_running_reqs"] == after["minisgl:num_queue_reqs"] == 0


def test_chat_stream_matches_non_stream(server: ServerProcess, client: openai.OpenAI, tokenizer):
    flush_cache(server)  # a cold cache: the first request computes its whole prompt
    response = client.chat.completions.create(
        model=MODEL, messages=USER_MESSAGES, max_tokens=20, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.object == "chat.completion" and response.id
    choice = response.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"  # ignore_eos: only max_tokens ends it
    usage = response.usage
    assert usage.prompt_tokens == len(chat_ids(tokenizer, USER_MESSAGES))
    assert usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20
    assert usage.prompt_tokens_details.cached_tokens == 0

    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER_MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    # The same prompt again: the radix cache holds all of it (page size 1), and the last
    # prompt token is computed anyway, since its logits give the first output token.
    cached = (usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_chat_content_parts_and_system(client: openai.OpenAI, tokenizer):
    parts = [
        {"type": "text", "text": "Write a short story "},
        {"type": "text", "text": "about a robot who learns to paint."},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=24, temperature=0
    )
    assert response.choices[0].message.content == greedy_chat(client)
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=conversation, max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(chat_ids(tokenizer, conversation))


def test_completion_prompt_shapes(server: ServerProcess, client: openai.OpenAI, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer("Once upon a time")["input_ids"])
    many_ids = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0
    )
    assert len(many_ids.choices) == 2
    assert many_ids.choices[0].text == many.choices[0].text
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_completion_stream_matches_non_stream(client: openai.OpenAI):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_default_max_tokens(server: ServerProcess, client: openai.OpenAI, tokenizer):
    """Completions default to 16 tokens (OpenAI, vLLM, SGLang), also for an explicit null;
    chat without max_tokens may use the rest of the context (vLLM)."""
    for extra in ({}, {"max_tokens": None}):
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True} | extra
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == OPENAI_COMPLETION_MAX_TOKENS
        assert response.json()["choices"][0]["finish_reason"] == "length"
    room = 3

    def chat_len(words: int) -> int:
        return len(chat_ids(tokenizer, [{"role": "user", "content": "hello " * words}]))

    low, high = 1, MAX_MODEL_LEN  # the most words whose prompt leaves `room` tokens or more
    for _ in range(MAX_MODEL_LEN.bit_length() + 1):
        if low >= high:
            break
        mid = (low + high + 1) // 2
        low, high = (mid, high) if chat_len(mid) <= MAX_MODEL_LEN - room else (low, mid - 1)
    messages = [{"role": "user", "content": "hello " * low}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == MAX_MODEL_LEN - chat_len(low) >= room
    assert response.choices[0].finish_reason == "length"


def test_logit_bias(server: ServerProcess, client: openai.OpenAI, tokenizer):
    """-100 bans a token, +100 forces one, on both endpoints."""

    def token_id(text: str) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.decode(ids) == text, (text, ids)
        return ids[0]

    def first_token(**extra) -> str:
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0, **extra
        )
        return response.choices[0].logprobs.tokens[0]

    top = first_token()
    assert first_token(logit_bias={str(token_id(top)): -100}) != top
    forced = post(
        server, "/v1/chat/completions",
        {"model": MODEL, "messages": USER_MESSAGES, "max_tokens": 3, "temperature": 0.7,
         "seed": 1, "logit_bias": {str(token_id(" banana")): 100}, "ignore_eos": True,
         "logprobs": True},
    )  # fmt: skip
    assert forced.status_code == 200, forced.text
    tokens = [e["token"] for e in forced.json()["choices"][0]["logprobs"]["content"]]
    assert tokens == [" banana"] * 3


def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess, tokenizer, hf):
    """echo + logprobs: every prompt token with its logprob under transformers' forward of the
    same checkpoint (the first token's is null), then the generated ones; max_tokens 0 only
    scores. The same again with the prompt in the prefix cache, and streamed."""
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "temperature": 0}
    for attempt in range(2):  # the second finds the prompt in the prefix cache
        scored = post(server, "/v1/completions", body | {"max_tokens": 0}).json()["choices"][0]
        assert scored["text"] == PROMPT and scored["finish_reason"] == "length", attempt
        lp = scored["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-3, rtol=0)
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    full = post(server, "/v1/completions", body | {"max_tokens": 3}).json()["choices"][0]
    assert full["text"].startswith(PROMPT)
    assert full["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    assert len(full["logprobs"]["tokens"]) == len(ids) + 3
    assert full["logprobs"]["text_offset"][len(ids)] == len(PROMPT)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body | {"max_tokens": 3, "stream": True},
        timeout=REQUEST_TIMEOUT_S,
    ) as response:  # fmt: skip
        events = [e for e in sse_events(response) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == PROMPT
    streamed = {"tokens": [], "token_logprobs": []}
    for event in events:
        for key in streamed:
            streamed[key] += (event["choices"][0]["logprobs"] or {}).get(key, [])
    assert streamed == {k: full["logprobs"][k] for k in streamed}
    echo_only = post(server, "/v1/completions", body | {"max_tokens": 0, "logprobs": None})
    assert echo_only.json()["choices"][0] == {
        "index": 0, "text": PROMPT, "logprobs": None, "finish_reason": "length",
        "stop_reason": None,
    }  # fmt: skip
    no_echo = post(server, "/v1/completions", body | {"max_tokens": 0, "echo": False})
    assert _error(no_echo, 400)["param"] == "max_tokens"
    # Characters split over byte tokens (each shows alone as U+FFFD): offsets never go back.
    cjk = post(server, "/v1/completions", body | {"prompt": "日本は東京", "max_tokens": 3})
    offsets = cjk.json()["choices"][0]["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and len(offsets) > 3, offsets
    # Scoring needs no room for output: a prompt filling the whole context is fine.
    full_context = list(ids * MAX_MODEL_LEN)[:MAX_MODEL_LEN]
    scored = post(server, "/v1/completions", body | {"prompt": full_context, "max_tokens": 0})
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["token_logprobs"]) == MAX_MODEL_LEN


def test_null_means_the_default_and_models_retrieve(server: ServerProcess, client):
    chat = {"model": MODEL, "messages": USER_MESSAGES, "max_tokens": 2}
    unset = ("n", "logprobs", "top_logprobs", "parallel_tool_calls", "stream", "stream_options")
    nulls = dict.fromkeys((*unset, "temperature", "logit_bias"))
    response = post(server, "/v1/chat/completions", chat | nulls)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": None, "n": None}
    response = post(server, "/v1/completions", completion)
    assert response.status_code == 200, response.text
    assert not response.json()["choices"][0]["text"].startswith(PROMPT)
    assert client.models.retrieve(MODEL).id == MODEL
    assert _error(httpx.get(server.url + "/v1/models/gpt-4"), 404)["param"] == "model"


# ---- stopping ------------------------------------------------------------------------------


def test_stop_strings(client: openai.OpenAI):
    reference = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = reference.choices[0].text
    assert len(text) > 12, text
    # Start mid-word, a few characters in: such a stop string usually spans token boundaries.
    stop = text[5:11]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=[stop, "zzzz"],
            stream=stream,
        )
        if stream:
            chunks = [c for c in response if c.choices]
            got = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            last = chunks[-1].choices[0]
        else:
            got, finish = response.choices[0].text, [response.choices[0].finish_reason]
            last = response.choices[0]
        assert got == expected and finish == ["stop"] and stop not in got
        assert last.stop_reason == stop  # vLLM's field: which stop ended it

    chat_text = greedy_chat(client)
    chat_stop = chat_text[3:8]
    stopped = greedy_chat(client, stop=chat_stop)
    assert stopped == chat_text[: chat_text.index(chat_stop)]
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=USER_MESSAGES,
        max_tokens=24,
        temperature=0,
        stop=chat_stop,
        stream=True,
    )
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == stopped
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    # vLLM's include_stop_str_in_output keeps the stop string, streamed or not
    kept = chat_text[: chat_text.index(chat_stop) + len(chat_stop)]
    assert greedy_chat(client, stop=chat_stop, extra_body={"include_stop_str_in_output": True}) == (
        kept
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected + stop


def test_stop_token_ids_and_eos(client: openai.OpenAI, tokenizer, hf):
    """A stop token from HF's greedy reply ends the reply there; EOS ends one (no stop_reason);
    ignore_eos, min_tokens and skip_special_tokens change an EOS-ending reply as HF says."""
    greedy, _ = hf_greedy(hf, tokenizer(PROMPT)["input_ids"], 8)
    stop_id = greedy[2]
    first = greedy.index(stop_id)
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].stop_reason == stop_id
    assert response.choices[0].text == tokenizer.decode(greedy[:first])
    assert response.usage.completion_tokens == first + 1  # the stop token counts, as in vLLM

    prompt = chat_ids(tokenizer, EOS_MESSAGES)
    reply, _ = hf_greedy(hf, prompt, 12)  # EOS is not a stop for this helper
    num_before_eos = reply.index(tokenizer.eos_token_id)
    assert num_before_eos + 1 < 12, tokenizer.decode(reply)  # EOS, then more to see
    chat = client.chat.completions.create(
        model=MODEL, messages=EOS_MESSAGES, max_tokens=12, temperature=0
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason is None  # by EOS, as vLLM
    assert choice.message.content == tokenizer.decode(reply[:num_before_eos])
    assert chat.usage.completion_tokens == num_before_eos + 1  # EOS counts, hidden

    def chat_with(**extra) -> tuple[str, str, int]:
        response = client.chat.completions.create(
            model=MODEL, messages=EOS_MESSAGES, max_tokens=12, temperature=0, extra_body=extra
        )
        choice = response.choices[0]
        return choice.message.content or "", choice.finish_reason, response.usage.completion_tokens

    # ignore_eos: EOS is just a token; the reply runs to max_tokens, EOS hidden in the text ...
    assert chat_with(ignore_eos=True) == (
        tokenizer.decode(reply, skip_special_tokens=True),
        "length",
        12,
    )
    # ... or shown, with skip_special_tokens false
    shown = chat_with(ignore_eos=True, skip_special_tokens=False)
    assert shown == (tokenizer.decode(reply, skip_special_tokens=False), "length", 12)
    assert tokenizer.eos_token in shown[0]
    # min_tokens: no EOS before that many tokens (HF's min_new_tokens)
    min_tokens = num_before_eos + 3
    longer = hf_generate(hf, prompt, 12, min_new_tokens=min_tokens)
    assert len(longer) >= min_tokens
    ends_at_eos = longer[-1] == tokenizer.eos_token_id
    assert chat_with(min_tokens=min_tokens) == (
        tokenizer.decode(longer, skip_special_tokens=True),
        "stop" if ends_at_eos else "length",
        len(longer),
    )


# ---- sampling ------------------------------------------------------------------------------


def test_n_and_seed(client: openai.OpenAI):
    def sample(seed: int | None, n: int = 2) -> list[str]:
        response = client.chat.completions.create(
            model=MODEL, messages=USER_MESSAGES, max_tokens=16, temperature=1.0, n=n, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in response.choices] == list(range(n))
        assert response.usage.completion_tokens == n * 16  # ignore_eos: each choice is 16
        return [c.message.content for c in response.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # seed + i per choice: different sequences
    assert sample(98765)[0] != first[0]  # another seed, another sample
    assert len(sample(None, n=3)) == 3

    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=7, stream=True
    )
    chunks = [c for c in stream if c.choices]
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_every_sampling_field_changes_what_it_should(
    server: ServerProcess, client: openai.OpenAI, tokenizer, hf
):
    """Unknown fields are ignored, so a 200 proves nothing: each field is set to a value that
    decides the reply, and the reply is checked against an oracle that is not minisgl."""
    num_tokens = 8
    prompt_ids = chat_ids(tokenizer, USER_MESSAGES)
    greedy_ids, _ = hf_greedy(hf, prompt_ids, num_tokens)
    greedy_text = tokenizer.decode(greedy_ids)

    def chat(**fields) -> str:
        body = {"model": MODEL, "messages": USER_MESSAGES, "max_tokens": num_tokens,
                "ignore_eos": True} | fields  # fmt: skip
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == num_tokens
        return response.json()["choices"][0]["message"]["content"]

    # temperature 0: HF's greedy continuation
    assert chat(temperature=0) == greedy_text
    # Sampling at temperature 1 with this seed leaves the greedy path ...
    sampled = chat(temperature=1.0, seed=5)
    assert sampled != greedy_text
    assert chat(temperature=1.0, seed=5) == sampled  # seed: reproducible
    # ... and each of these keeps only the most likely token, whatever the seed draws:
    assert chat(temperature=1.0, seed=5, top_k=1) == greedy_text
    assert chat(temperature=1.0, seed=5, top_p=1e-6) == greedy_text  # the smallest nucleus
    assert chat(temperature=1.0, seed=5, min_p=1.0) == greedy_text  # p >= 1.0 x the top p
    # Fields the server does not know are ignored, known ones like `user` too
    assert chat(temperature=0, user="tester", some_future_openai_field={"x": 1}) == greedy_text

    # Penalties, on a prompt whose greedy continuation repeats one token
    repeat_ids = tokenizer(REPEAT_PROMPT)["input_ids"]
    plain = hf_generate(hf, repeat_ids, num_tokens)
    assert len(set(plain)) == 1, tokenizer.decode(plain)

    def completion(**fields) -> str:
        body = {"model": MODEL, "prompt": REPEAT_PROMPT, "max_tokens": num_tokens,
                "temperature": 0, "ignore_eos": True} | fields  # fmt: skip
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert completion() == tokenizer.decode(plain)
    # HF's RepetitionPenaltyLogitsProcessor: prompt and output tokens
    want = hf_generate(hf, repeat_ids, num_tokens, repetition_penalty=1.3)
    assert want != plain and completion(repetition_penalty=1.3) == tokenizer.decode(want)
    # OpenAI's presence and frequency penalties: output tokens only
    for name, value in (("presence", 2.0), ("frequency", 0.5)):
        processor = OpenAIPenalties(len(repeat_ids), **{name: value})
        want = hf_generate(
            hf, repeat_ids, num_tokens, logits_processor=LogitsProcessorList([processor])
        )
        assert want != plain, name
        assert completion(**{f"{name}_penalty": value}) == tokenizer.decode(want), name


def test_logprobs(client: openai.OpenAI, tokenizer, hf):
    """The chosen token's logprob and the top alternatives are HF's log-softmax of the raw
    logits (before sampling), on both endpoints."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER_MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    greedy, steps = hf_greedy(hf, chat_ids(tokenizer, USER_MESSAGES), 6)
    for entry, token_id, step in zip(content, greedy, steps, strict=True):
        assert entry.token == tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(step[token_id].item(), abs=LOGPROB_ATOL)
        top = step.topk(3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in top.indices]
        got = torch.tensor([t.logprob for t in entry.top_logprobs])
        torch.testing.assert_close(got, top.values, atol=LOGPROB_ATOL, rtol=0)
    assert "".join(e.token for e in content) == chat.choices[0].message.content

    streamed = client.chat.completions.create(
        model=MODEL,
        messages=USER_MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in entries)

    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert completion.usage.completion_tokens == 6
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 6
    greedy, steps = hf_greedy(hf, tokenizer(PROMPT)["input_ids"], 6)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in greedy]
    want = torch.stack([step[t] for step, t in zip(steps, greedy, strict=True)])
    torch.testing.assert_close(
        torch.tensor(logprobs.token_logprobs), want, atol=LOGPROB_ATOL, rtol=0
    )
    for top, step in zip(logprobs.top_logprobs, steps, strict=True):
        best = step.topk(2)
        assert list(top) == [tokenizer.decode([i]) for i in best.indices]
        torch.testing.assert_close(
            torch.tensor(list(top.values())), best.values, atol=LOGPROB_ATOL, rtol=0
        )
    # character offsets of each token in the text: the lengths of the tokens before it
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == completion.choices[0].text


# ---- errors --------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_bad_requests(server: ServerProcess, client: openai.OpenAI, tokenizer):
    chat = {"model": MODEL, "messages": USER_MESSAGES, "max_tokens": 4}
    assert (
        _error(post(server, "/v1/chat/completions", chat | {"temperature": -1}), 400)["param"]
        == "temperature"
    )
    assert (
        _error(post(server, "/v1/chat/completions", chat | {"top_p": 2}), 400)["param"] == "top_p"
    )
    assert (
        _error(post(server, "/v1/chat/completions", chat | {"max_tokens": "many"}), 400)["param"]
        == "max_tokens"
    )
    assert _error(post(server, "/v1/chat/completions", chat | {"n": 0}), 400)["param"] == "n"
    assert (
        _error(
            post(
                server,
                "/v1/chat/completions",
                chat | {"messages": [{"role": "robot", "content": "x"}]},
            ),
            400,
        )["param"]
        == "messages"
    )
    assert (
        _error(post(server, "/v1/completions", {"model": MODEL, "prompt": ""}), 400)["param"]
        == "prompt"
    )
    assert (
        _error(post(server, "/v1/completions", {"model": MODEL, "prompt": [10**9]}), 400)["param"]
        == "prompt"
    )
    not_json = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    _error(not_json, 400)
    assert (
        _error(post(server, "/v1/chat/completions", chat | {"model": "gpt-4"}), 404)["code"] == 404
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER_MESSAGES, max_tokens=2)

    long_prompt = "hello " * MAX_MODEL_LEN
    num_prompt_tokens = len(tokenizer(long_prompt)["input_ids"])
    error = _error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 10}),
        400,
    )
    assert (
        str(MAX_MODEL_LEN) in error["message"] and str(num_prompt_tokens + 10) in error["message"]
    )
    short_ids = tokenizer(PROMPT)["input_ids"]
    error = _error(
        post(
            server,
            "/v1/completions",
            {"model": MODEL, "prompt": short_ids, "max_tokens": MAX_MODEL_LEN},
        ),
        400,
    )
    assert (
        str(MAX_MODEL_LEN) in error["message"]
        and str(len(short_ids) + MAX_MODEL_LEN) in error["message"]
    )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=-3)
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for path, body, param in [
        ("/v1/chat/completions", chat | {"logit_bias": {"foo": 1}}, "logit_bias"),
        ("/v1/chat/completions", chat | {"logit_bias": {"5": 200}}, "logit_bias"),
        ("/v1/completions", completion | {"logit_bias": {"5": "x"}}, "logit_bias"),
        ("/v1/completions", completion | {"logit_bias": {str(10**7): 1}}, "logit_bias"),
        ("/v1/chat/completions", chat | {"stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/chat/completions", chat | {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", chat | {"messages": [{"role": "user"}]}, "messages"),
        ("/v1/completions", completion | {"suffix": "abc"}, "suffix"),
        ("/v1/completions", completion | {"best_of": 3}, "best_of"),
    ]:  # fmt: skip
        assert _error(post(server, path, body), 400)["param"] == param, body
    # No bad request disturbed the server.
    assert greedy_chat(client, max_tokens=3)
    assert server.metrics()["minisgl:num_running_reqs"] == 0


# ---- load and disconnects ------------------------------------------------------------------


def _wait_idle(server: ServerProcess) -> dict[str, float]:
    deadline_s = time.monotonic() + DRAIN_TIMEOUT_S
    metrics = server.metrics()
    while time.monotonic() < deadline_s:
        metrics = server.metrics()
        if (
            metrics["minisgl:num_running_reqs"] == 0
            and metrics["minisgl:kv_cache_usage_ratio"] == 0
        ):
            return metrics
        time.sleep(0.2)
    raise AssertionError(f"requests not freed within {DRAIN_TIMEOUT_S} s: {metrics}")


def test_client_disconnect_aborts(server: ServerProcess):
    body = {"model": MODEL, "messages": USER_MESSAGES, "max_tokens": 900, "ignore_eos": True}
    before = _wait_idle(server)
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json=body | {"stream": True},
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        lines = response.iter_lines()
        for _ in range(8):  # a few tokens in, then hang up
            next(lines)
    assert server.metrics()["minisgl:num_running_reqs"] <= 1
    _wait_idle(server)
    # Non-streaming: the client gives up (timeout) while the request still runs.
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/chat/completions", body, timeout=1.0)
    after = _wait_idle(server)

    def grew(name: str) -> float:
        return after[f"minisgl:{name}"] - before[f"minisgl:{name}"]

    assert grew("aborted_requests_total") == 2  # these two requests, nothing else
    assert grew('request_success_total{finished_reason="abort"}') == 2
    assert grew("generation_tokens_total") < 2 * 900  # both stopped early


def test_concurrent_clients(server: ServerProcess):
    async def one(http: httpx.AsyncClient, i: int) -> dict:
        body = {
            "model": MODEL,
            "prompt": f"{i} little pigs went",
            "max_tokens": 6,
            "temperature": 0,
        }
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
            return await asyncio.gather(*(one(http, i) for i in range(NUM_CONCURRENT_CLIENTS)))

    results = asyncio.run(main())
    assert len(results) == NUM_CONCURRENT_CLIENTS
    assert all(r["usage"]["completion_tokens"] >= 1 for r in results)
    assert len({r["id"] for r in results}) == NUM_CONCURRENT_CLIENTS
    _wait_idle(server)


# ---- /v1/embeddings (oracles offline: tests/test_embeddings.py) -----------------------------

EMBED_TEXTS = ["The history of the city of Paris began", "Embeddings", "go go go " * 40]


def test_embeddings_sdk_batched_concurrent_and_with_generation(
    server: ServerProcess, client: openai.OpenAI, tokenizer
):
    """The SDK's float and (its default) base64 replies agree; a batch, one request per text and
    concurrent requests agree within fp32 rounding, while a generation runs beside them; the
    vectors are unit length (mean pooling, normalised); usage counts the prompt tokens; every
    page is back after, and /metrics counts the requests."""
    before = server.metrics()
    floats = client.embeddings.create(model=MODEL, input=EMBED_TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=EMBED_TEXTS)  # base64 on the wire
    batch = torch.tensor([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL
    # (batch composition, hence fp32 rounding, may differ between two requests)
    assert torch.allclose(torch.tensor([d.embedding for d in decoded.data]), batch, atol=1e-5)
    assert torch.allclose(batch.norm(dim=1), torch.ones(3), atol=1e-5)
    num_tokens = sum(len(tokenizer(text)["input_ids"]) for text in EMBED_TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens

    async def embed(http: httpx.AsyncClient, text: str | list[int]) -> list[float]:
        response = await http.post("/v1/embeddings", json={"input": text, "model": MODEL})
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    async def generate(http: httpx.AsyncClient) -> dict:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        return (await http.post("/v1/completions", json=body)).json()

    async def main() -> tuple[dict, list[list[float]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
            texts = [*EMBED_TEXTS, *EMBED_TEXTS, tokenizer(EMBED_TEXTS[1])["input_ids"]]
            return await asyncio.gather(generate(http), *(embed(http, t) for t in texts))

    generated, *concurrent = asyncio.run(main())
    assert generated["usage"]["completion_tokens"] == 24
    one_by_one = [
        client.embeddings.create(model=MODEL, input=t, encoding_format="float") for t in EMBED_TEXTS
    ]
    for got in (
        torch.tensor(concurrent[:3]),
        torch.tensor(concurrent[3:6]),
        torch.tensor([r.data[0].embedding for r in one_by_one]),
    ):
        assert torch.allclose(got, batch, atol=1e-5)
    assert torch.allclose(torch.tensor(concurrent[6]), batch[1], atol=1e-5)
    after = _wait_idle(server)
    count = "minisgl:embedding_requests_total"
    assert after[count] - before.get(count, 0) == 3 + 3 + 7 + 3
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["pooling"] == {"mode": "mean", "normalize": True}


def test_embeddings_bad_requests(server: ServerProcess, tokenizer):
    too_long = "go " * (MAX_MODEL_LEN + 10)
    cases = [
        ({"input": []}, 400, "input"),
        ({"input": ["fine", ""]}, 400, "input[1]"),
        ({"input": [[1, 2], [10**9]]}, 400, "input[1]"),
        ({"input": ["fine", too_long]}, 400, "input[1]"),
        ({"input": "x", "dimensions": 8}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "bytes"}, 400, "encoding_format"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({"input": ["x"] * 257}, 400, "input"),  # over --max-sequences-per-request
    ]
    for body, status, param in cases:
        response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    # vLLM's truncate_prompt_tokens keeps the last N tokens: the same as sending them
    ids = tokenizer(too_long)["input_ids"]
    replies = [
        httpx.post(server.url + "/v1/embeddings", json=body, timeout=REQUEST_TIMEOUT_S).json()
        for body in ({"input": too_long, "truncate_prompt_tokens": 5}, {"input": ids[-5:]})
    ]
    assert replies[0]["data"] == replies[1]["data"] and replies[0]["usage"]["prompt_tokens"] == 5
    _wait_idle(server)


# ---- process lifecycle ---------------------------------------------------------------------


def test_api_key_health_and_child_death():
    """Second server: 401 without the key, 503 while the scheduler is frozen, and a non-zero
    exit (with no stray processes) when the scheduler dies."""
    srv = start_server("--num-pages", str(SMALL_KV_POOL_PAGES), api_key="sekrit")
    try:
        srv.wait_healthy()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        _error(post(srv, "/v1/completions", body), 401)
        _error(post(srv, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert post(srv, "/v1/completions", body, headers=srv.headers).status_code == 200
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert keyed.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
        assert httpx.get(srv.url + "/health").status_code == 200  # /health and /metrics: no key

        # A KV pool smaller than the context: rejected up front (stream or not) ...
        too_big = body | {"max_tokens": SMALL_KV_POOL_PAGES + 10}
        for stream in (False, True):
            request = too_big | {"stream": stream}
            rejected = _error(post(srv, "/v1/completions", request, headers=srv.headers), 400)
            assert "KV cache" in rejected["message"] and rejected["param"] == "max_tokens"
        # ... and the default max_tokens fits what the pool can hold, not the whole context.
        no_limit = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "stop": "."}
        response = post(srv, "/v1/completions", no_limit, headers=srv.headers)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["total_tokens"] <= SMALL_KV_POOL_PAGES

        scheduler = next(p for p in srv.children if p.name() == "minisgl:sched")
        scheduler.suspend()  # alive but not answering
        try:
            assert httpx.get(srv.url + "/health", timeout=10.0).status_code == 503
        finally:
            scheduler.resume()
        assert httpx.get(srv.url + "/health", timeout=10.0).status_code == 200

        scheduler.kill()
        srv.proc.wait(timeout=20.0)
        assert srv.proc.returncode != 0
        time.sleep(1.0)
        assert not [p for p in srv.children if alive(p)]
    finally:
        srv.stop()


def test_tensor_parallel_server_matches(client: openai.OpenAI):
    """--tp 3 (SmolLM2 has 9 heads and 3 KV heads): same greedy text, clean shutdown."""
    reference = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    srv = start_server("--tp", str(TP_SIZE))
    try:
        srv.wait_healthy()
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        response = post(srv, "/v1/completions", body)
        assert response.json()["choices"][0]["text"] == reference.choices[0].text
        assert srv.stop() == 0
        deadline_s = time.monotonic() + 10.0
        while any(alive(p) for p in children) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert not [p for p in children if alive(p)]
    finally:
        srv.stop()


def test_tensor_parallel_rank_death_stops_server():
    """Killing one tp rank makes the whole server exit non-zero, leaving no process behind."""
    srv = start_server("--tp", str(TP_SIZE))
    try:
        srv.wait_healthy()
        everyone = psutil.Process(srv.proc.pid).children(recursive=True)
        sched = next(p for p in everyone if p.name().startswith("minisgl:sched"))
        followers = sched.children()
        assert len(followers) == TP_SIZE - 1
        followers[0].kill()
        srv.proc.wait(timeout=60.0)
        assert srv.proc.returncode != 0
        deadline_s = time.monotonic() + 10.0
        while any(alive(p) for p in everyone) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert not [p for p in everyone if alive(p)]
    finally:
        srv.stop()


def test_sigterm_stops_everything(server: ServerProcess):
    """Runs last: it stops the module's server. An open stream that outlives --shutdown-timeout
    ends cleanly, as aborted (test_shutdown: one that finishes in time completes)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert len(children) >= 3
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(server.proc.pid, signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(timeout=30.0) == 0
    deadline_s = time.monotonic() + 10.0
    while any(alive(p) for p in children) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)]
    assert "minisgl serving" in server.log()
