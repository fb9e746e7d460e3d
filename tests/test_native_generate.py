"""SGLang's native endpoints on a real server: POST /generate (what `sglang.bench_serving
--backend sglang` and SGLang scripts send) and /flush_cache.

The oracle for /generate is the same server's OpenAI endpoint: a greedy request must give the
same tokens, logprobs and usage there, in SGLang's response layout here.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_utils import ServerProcess

REQUEST_TIMEOUT_S = 120.0
PROMPT = "The history of the city of Paris began"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT_S)


def greedy(**extra) -> dict:
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"text": PROMPT, "sampling_params": params, **extra}


def completion(server: ServerProcess, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = post(server, "/v1/completions", body | extra)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_matches_the_openai_endpoint(server: ServerProcess):
    want = completion(server, logprobs=2, echo=True)
    out = post(server, "/generate", greedy(return_logprob=True, top_logprobs_num=2,
                                           logprob_start_len=0))  # fmt: skip
    assert out.status_code == 200, out.text
    out = out.json()
    choice = want["choices"][0]
    assert PROMPT + out["text"] == choice["text"]
    assert len(out["output_ids"]) == MAX_NEW_TOKENS
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW_TOKENS}
    assert meta["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert meta["completion_tokens"] == MAX_NEW_TOKENS and meta["e2e_latency"] > 0
    # Logprobs: [logprob, token id, null]; the prompt's from position 0, the first null.
    lps = choice["logprobs"]["token_logprobs"]
    num_prompt = meta["prompt_tokens"]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(lps[num_prompt:])
    assert [e[0] for e in meta["input_token_logprobs"]] == [None, *lps[1:num_prompt]]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["input_top_logprobs"][0] is None
    # The same by token ids, and from a later prompt position.
    ids = [e[1] for e in meta["input_token_logprobs"]]
    by_ids = post(server, "/generate", {**greedy(return_logprob=True, logprob_start_len=3),
                                        "text": None, "input_ids": ids}).json()  # fmt: skip
    assert by_ids["output_ids"] == out["output_ids"]
    assert by_ids["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"][3:]


def test_generate_batch_n_and_stream(server: ServerProcess):
    body = greedy(text=[PROMPT, "Once upon a time"], rid=["first", "second"])
    body["sampling_params"] |= {"n": 2}
    outs = post(server, "/generate", body).json()
    assert isinstance(outs, list) and [o["index"] for o in outs] == [0, 1, 2, 3]
    # a list of rids: one per prompt, shared by that prompt's n sequences
    assert [o["meta_info"]["id"] for o in outs] == ["first", "first", "second", "second"]
    wrong = post(server, "/generate", {**body, "rid": ["only-one"]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "rid"
    single = post(server, "/generate", greedy()).json()
    assert outs[0]["text"] == outs[1]["text"] == single["text"]  # greedy: n copies agree
    assert outs[2]["meta_info"]["prompt_tokens"] != outs[0]["meta_info"]["prompt_tokens"]
    with httpx.stream("POST", server.url + "/generate", json=greedy(stream=True),
                      timeout=REQUEST_TIMEOUT_S) as response:  # fmt: skip
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert chunks[-1]["text"] == single["text"]
    assert chunks[-1]["output_ids"] == single["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_trimmed_unless_no_stop_trim(server: ServerProcess):
    text = post(server, "/generate", greedy()).json()["text"]
    stop = text[4:9]  # mid-word: it usually spans tokens
    cut = text[: text.index(stop)]
    for no_stop_trim, expected in ((False, cut), (True, cut + stop)):
        body = greedy()
        body["sampling_params"] |= {"stop": [stop], "no_stop_trim": no_stop_trim}
        out = post(server, "/generate", body).json()
        assert out["text"] == expected
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_generate_prefill_only(server: ServerProcess):
    """max_new_tokens 0 (SGLang's prefill-only request): no output, the prompt counted."""
    body = greedy()
    body["sampling_params"]["max_new_tokens"] = 0
    out = post(server, "/generate", body)
    assert out.status_code == 200, out.text
    out = out.json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0 and out["meta_info"]["prompt_tokens"] > 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_min_new_tokens_and_min_tokens(server: ServerProcess):
    """A stop token the greedy reply reaches at its 2nd token ends it there; with 4 minimum
    tokens it cannot (/generate's min_new_tokens, the OpenAI endpoints' min_tokens)."""
    base = post(server, "/generate", greedy()).json()["output_ids"]
    body = greedy()
    body["sampling_params"] |= {"stop_token_ids": [base[1]], "ignore_eos": False}
    stopped = post(server, "/generate", body).json()
    assert len(stopped["output_ids"]) <= 2
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": base[1]}
    body["sampling_params"]["min_new_tokens"] = 4
    held = post(server, "/generate", body).json()
    assert held["meta_info"]["completion_tokens"] >= 4 and base[1] not in held["output_ids"][:4]
    openai = {"prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
              "stop_token_ids": [base[1]], "min_tokens": 4}  # fmt: skip
    response = post(server, "/v1/completions", openai)
    assert response.json()["usage"]["completion_tokens"] >= 4, response.text
    too_many = post(server, "/v1/completions", openai | {"min_tokens": MAX_NEW_TOKENS + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"


def test_generate_constraint_seed_and_bad_input(server: ServerProcess):
    constrained = greedy()
    constrained["sampling_params"] = {"regex": "(yes|no)", "max_new_tokens": 5}
    assert post(server, "/generate", constrained).json()["text"] in ("yes", "no")
    seeded = greedy()
    seeded["sampling_params"] |= {"temperature": 1.0, "sampling_seed": 7}
    first, again = (post(server, "/generate", seeded).json()["text"] for _ in range(2))
    assert first == again
    bad = [
        ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
        ({"sampling_params": {}}, "text"),
        (greedy(sampling_params={"temperature": -1}), "sampling_params.temperature"),
        (greedy(sampling_params={"max_new_tokens": 10**6}), "sampling_params.max_new_tokens"),
        (greedy(sampling_params={"top_k": "x"}), "sampling_params"),
        (greedy(input_ids=None, text=None), "text"),
        (greedy(top_logprobs_num=50), "top_logprobs_num"),
        (greedy(return_logprob=True, logprob_start_len=10**4), "logprob_start_len"),
        ({"input_ids": [10**8]}, "input_ids"),
    ]
    for body, param in bad:
        response = post(server, "/generate", body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    assert post(server, "/generate", greedy()).status_code == 200  # still serving


def test_flush_cache(server: ServerProcess):
    post(server, "/generate", greedy())
    cached = post(server, "/generate", greedy()).json()["meta_info"]["cached_tokens"]
    assert cached > 0
    response = httpx.post(server.url + "/flush_cache", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200 and "flushed" in response.text
    assert post(server, "/generate", greedy()).json()["meta_info"]["cached_tokens"] == 0
    assert httpx.get(server.url + "/flush_cache", timeout=REQUEST_TIMEOUT_S).status_code == 200
