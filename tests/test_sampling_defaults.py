"""The model's recommended sampling (generation_config.json) fills what a request leaves unset
(--sampling-defaults model, the default, as in SGLang and vLLM); explicit fields win."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from minisgl.api.dialects.completions import CompletionRequest
from minisgl.api.request import choice_params
from minisgl.config import ServerArgs
from minisgl.limits import ModelLimits
from minisgl.models.model_config import load_sampling_defaults
from tests.server_utils import ServerProcess, running_server

HTTP_TIMEOUT_S = 60.0
MAX_TOKENS = 16
PROMPT = "The capital of France is"


def _with_generation_config(src: Path, dst: Path, values: dict) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **values}))
    return dst


def test_reads_the_sampling_keys_it_knows(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "repetition_penalty": None, "min_p": "x", "eos_token_id": [1, 2]})
    )  # fmt: skip
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert load_sampling_defaults(tmp_path / "missing") == {}


def _params(body: CompletionRequest, defaults: dict) -> object:
    limits = ModelLimits(max_model_len=64, vocab_size=100, kv_capacity_tokens=64)
    return choice_params(body.to_api(), 0, [1, 2], limits, defaults, None)[0]


def test_unset_fields_take_the_defaults_and_set_ones_win(tmp_path):
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    unset = _params(CompletionRequest(prompt="x"), defaults)
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.6, 20, 0.95)
    body = CompletionRequest(prompt="x", temperature=0, top_k=0)
    explicit = _params(body, defaults)
    assert (explicit.temperature, explicit.top_k, explicit.top_p) == (0.0, 0, 0.95)
    plain = _params(CompletionRequest(prompt="x"), {})
    assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, -1, 1.0)  # the OpenAI API's
    (tmp_path / "generation_config.json").write_text(json.dumps(defaults))
    assert load_sampling_defaults(tmp_path, ServerArgs().sampling_defaults) == defaults
    assert load_sampling_defaults(tmp_path, "openai") == {}  # --sampling-defaults openai
    with pytest.raises(ValueError, match="sampling_defaults"):
        ServerArgs(model=str(tmp_path), sampling_defaults="hf")


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory) -> Iterator[ServerProcess]:
    # top_k 1 makes the model's default draw greedy, whatever the temperature.
    model = _with_generation_config(
        tiny_qwen3, tmp_path_factory.mktemp("gen") / "m", {"temperature": 1.5, "top_k": 1}
    )
    with running_server("--model", str(model)) as srv:
        yield srv


def _complete(server: ServerProcess, **fields) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, **fields},
                   timeout=HTTP_TIMEOUT_S)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_server_applies_the_model_defaults(server):
    greedy = _complete(server, temperature=0)
    assert _complete(server) == greedy  # top_k 1 from generation_config.json
    assert "sampling defaults from the model's generation_config.json" in server.log()
    # An explicit top_k (0: off) overrides it: temperature 1.5 from the model then samples.
    sampled = [_complete(server, top_k=0, seed=s) for s in range(3)]
    assert any(tokens != greedy for tokens in sampled)
