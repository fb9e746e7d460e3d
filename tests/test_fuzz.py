"""Property-based fuzzing of the generation endpoints (completions, chat, OpenAI's responses,
Anthropic's messages) and /tokenize, /detokenize against a real server.

Hypothesis builds request bodies that mix valid fields with hostile ones: huge and negative
integers, NaN and infinities, lone surrogates, wrong types, nested junk, unknown fields, raw
bytes that are not JSON. The properties: no response is a 5xx (a stream carries no 5xx error
event and ends with [DONE]), every error has OpenAI's shape, and afterwards the server is
healthy, idle, has every KV page back and never logged a traceback.

The work is bounded: --max-model-len caps every sequence at MAX_MODEL_LEN tokens and
--max-sequences-per-request caps the fan-out, so an example costs at most a few hundred
milliseconds. Examples are derandomized (the same in every CI run); set MINISGL_FUZZ_RANDOM=1
to explore new ones, MINISGL_FUZZ_EXAMPLES to change how many.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import QWEN3_VOCAB
from tests.server_utils import ServerProcess, running_server, wait_idle

MAX_MODEL_LEN = 64
MAX_SEQUENCES = 4
MAX_BODY_BYTES = 64 * 1024
SERVER_FLAGS = (
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-sequences-per-request", str(MAX_SEQUENCES),
    "--max-request-body-bytes", str(MAX_BODY_BYTES),
)  # fmt: skip
NUM_EXAMPLES = int(os.environ.get("MINISGL_FUZZ_EXAMPLES", "300"))
DERANDOMIZE = os.environ.get("MINISGL_FUZZ_RANDOM", "") != "1"
HTTP_TIMEOUT_S = 60.0
ERROR_KEYS = {"message", "type", "param", "code"}
END_EVENTS = {"response.completed", "response.incomplete", "response.failed"}

# ---- strategies ------------------------------------------------------------------------------

SPECIAL_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
SPECIAL_INTS += [QWEN3_VOCAB - 1, QWEN3_VOCAB, QWEN3_VOCAB + 1]
valid_text = st.text(st.characters(codec="utf-8"), max_size=12)
# Any code point, lone surrogates (which JSON's \u escapes can carry) included.
hostile_text = st.text(st.characters(codec=None) | st.characters(categories=["Cs"]), max_size=6)
wild_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(SPECIAL_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    valid_text,
    hostile_text,
)
wild = st.recursive(
    wild_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=8,
)

# Valid values, edges included: a body built from these alone should get a 200.
token_ids = st.integers(min_value=0, max_value=1000) | st.just(QWEN3_VOCAB - 1)
prompt_text = st.sampled_from(["The sea is", "Hello", "1 2 3"]) | valid_text.filter(bool)
SAMPLING = {
    "model": st.none(),
    "max_tokens": st.integers(min_value=1, max_value=8) | st.none(),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.sampled_from([-1, 0, 1, 5, QWEN3_VOCAB]),
    "min_p": st.floats(min_value=0, max_value=1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 8),
    "stop": valid_text.filter(bool) | st.lists(valid_text.filter(bool), max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(min_value=1, max_value=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": valid_text,
}
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}), min_size=1, max_size=3
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": valid_text | content_parts},
)
CHAT_REQUIRED = {"messages": st.lists(message, min_size=1, max_size=3)}
CHAT = {
    "max_completion_tokens": st.integers(min_value=1, max_value=8),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5),
}
COMPLETION_REQUIRED = {
    "prompt": prompt_text
    | st.lists(prompt_text, min_size=1, max_size=2)
    | st.lists(token_ids, min_size=1, max_size=6)
    | st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=2)
}
COMPLETION = {"logprobs": st.integers(min_value=0, max_value=5), "echo": st.booleans()}
call_id = st.sampled_from(["call_1", "call_2"])
response_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"])},
        optional={
            "type": st.just("message"),
            "content": valid_text
            | st.lists(
                st.fixed_dictionaries({"type": st.just("input_text"), "text": valid_text}),
                max_size=2,
            ),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": call_id, "name": st.just("f"),
         "arguments": st.sampled_from(["{}", '{"a": 1}', "not json"])}
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": call_id, "output": valid_text}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning"), "summary": st.just([]),
         "content": st.just([{"type": "reasoning_text", "text": "hm"}])}
    ),
)  # fmt: skip
RESPONSES_REQUIRED = {"input": prompt_text | st.lists(response_item, min_size=1, max_size=4)}
RESPONSES = {
    "max_output_tokens": st.integers(min_value=1, max_value=8),
    "instructions": valid_text,
    "store": st.booleans(),
    "previous_response_id": st.just("resp_unknown"),
    "tools": st.just([{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    "text": st.sampled_from(
        [{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
         {"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer"}}}]
    ),
    "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "low", "high"])}),
    "include": st.just(["message.output_text.logprobs"]),
    "top_logprobs": st.integers(min_value=0, max_value=5),
}  # fmt: skip
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": call_id, "content": valid_text}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": call_id, "name": st.just("f"),
         "input": st.just({"a": 1})}
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": valid_text,
                           "signature": st.just("")}),
)  # fmt: skip
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": valid_text | st.lists(anthropic_block, max_size=3),
    }
)
# max_tokens, which Anthropic requires, comes from SAMPLING: present or not, as a client sends it.
MESSAGES_REQUIRED = {"messages": st.lists(anthropic_message, min_size=1, max_size=3)}
MESSAGES = {
    "system": valid_text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                          "text": valid_text}), max_size=2),
    "stop_sequences": st.lists(valid_text.filter(bool), max_size=2),
    "tools": st.just([{"name": "f", "input_schema": {"type": "object"}}]),
    "tool_choice": st.sampled_from(
        [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"},
         {"type": "any", "disable_parallel_tool_use": True}]
    ),
    "thinking": st.sampled_from(
        [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]
    ),
}  # fmt: skip
TOKENIZE_REQUIRED = {"prompt": prompt_text}
TOKENIZE = {"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}
DETOKENIZE_REQUIRED = {"tokens": st.lists(token_ids, max_size=6)}


@st.composite
def bodies(draw, required: dict, optional: dict) -> dict:
    """A valid body, then up to two fields (known or not) replaced by anything at all."""
    body = draw(st.fixed_dictionaries(required, optional={**SAMPLING, **optional}))
    names = st.sampled_from(sorted({*required, *SAMPLING, *optional})) | hostile_text
    for name in draw(st.lists(names, max_size=2, unique=True)):
        body[name] = draw(wild)
    return body


def encode(body: Any) -> bytes:
    # ensure_ascii: lone surrogates travel as \\udXXX escapes, as a client's JSON would carry them
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'"text"',
            b'{"prompt": "\xff\xfe"}',
            b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}',
            b"[" * 50_000 + b"]" * 50_000,
            b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b'{"prompt": "x", "max_tokens": 1e999}',
            b'{"prompt": "x", "max_tokens": -Infinity}',
            b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}',
        ]
    ),
)
PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/tokenize",
    "/detokenize",
]
VALID = [
    ("/v1/completions", bodies(COMPLETION_REQUIRED, COMPLETION)),
    ("/v1/chat/completions", bodies(CHAT_REQUIRED, CHAT)),
    ("/v1/responses", bodies(RESPONSES_REQUIRED, RESPONSES)),
    ("/v1/messages", bodies(MESSAGES_REQUIRED, MESSAGES)),
    ("/tokenize", bodies(TOKENIZE_REQUIRED, TOKENIZE)),
    ("/tokenize", bodies(CHAT_REQUIRED, TOKENIZE)),
    ("/detokenize", bodies(DETOKENIZE_REQUIRED, {})),
]
# Nesting around the 128-level bound and far past it (Python's recursion limit is ~1,000),
# as JSON or as JSON text inside a string (a tool call's arguments, a schema given as text).
nested = st.builds(
    lambda depth, obj: (
        b'{"a":' * depth + b"1" + b"}" * depth if obj else b"[" * depth + b"]" * depth
    ),
    st.integers(min_value=100, max_value=1500),
    st.booleans(),
)
nested = nested | nested.map(lambda raw: json.dumps(raw.decode()).encode())
FIELDS_PARSED_DEEPLY = ["metadata", "chat_template_kwargs", "tools", "response_format", "input",
                        "messages", "sampling_params", "logit_bias", "unknown"]  # fmt: skip


def with_field(body: bytes, name: str, value: bytes) -> bytes:
    """`body` (a JSON object) with `name` set to raw JSON `value`."""
    return body[:-1] + b", " + json.dumps(name).encode() + b": " + value + b"}"


requests = st.one_of(
    *(st.tuples(st.just(path), valid.map(encode)) for path, valid in VALID),
    *(
        st.tuples(
            st.just(path),
            st.builds(with_field, valid.map(encode), st.sampled_from(FIELDS_PARSED_DEEPLY), nested),
        )
        for path, valid in VALID
    ),
    st.tuples(
        st.sampled_from(PATHS),
        st.one_of(raw_bodies, wild.map(encode)),
    ),
)


# ---- the properties --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_qwen3) -> Iterator[ServerProcess]:
    with running_server("--model", str(tiny_qwen3), *SERVER_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _check_error(error: Any, where: str) -> None:
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, where
    assert isinstance(error["message"], str) and error["message"], where


def _check_response(path: str, raw: bytes, response: httpx.Response) -> None:
    where = f"{path} {raw[:300]!r} -> {response.status_code} {response.text[:500]}"
    assert response.status_code < 500, where
    if response.status_code != 200 and path == "/v1/messages":  # Anthropic's error shape
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, where
        return
    if response.status_code != 200:
        _check_error(response.json().get("error"), where)
        return
    if not response.headers["content-type"].startswith("text/event-stream"):
        key = {"/v1/responses": "output", "/v1/messages": "content", "/tokenize": "tokens",
               "/detokenize": "prompt"}  # fmt: skip
        assert key.get(path, "choices") in response.json(), where
        return
    if path == "/v1/messages":  # Anthropic's events: message_stop last, or an error event
        events = [json.loads(line[len("data: ") :]) for line in response.text.splitlines()
                  if line.startswith("data: ")]  # fmt: skip
        assert events[-1]["type"] in ("message_stop", "error"), where
        assert all(e["type"] != "error" or e["error"]["type"] != "api_error" for e in events)
        return
    if path == "/v1/responses":  # OpenAI's events: no [DONE]; a failure is error + failed
        events = [json.loads(line[len("data: ") :]) for line in response.text.splitlines()
                  if line.startswith("data: ")]  # fmt: skip
        assert events[-1]["type"] in END_EVENTS, where
        for event in events:
            assert event["type"] != "error" or event["code"] != "server_error", where
        return
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events and events[-1] == "[DONE]", where
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            _check_error(event["error"], where)
            assert event["error"]["code"] < 500, where


def test_no_request_gets_a_5xx_and_the_server_ends_clean(server: ServerProcess, http):
    """The fuzzer, then what it left behind: healthy, idle, every KV page back, and nothing
    logged a traceback while it ran (self-contained: it does not rely on test order)."""
    log_start = len(server.log())

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        derandomize=DERANDOMIZE,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=requests)
    def no_request_gets_a_5xx(request: tuple[str, bytes]) -> None:
        path, raw = request
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        _check_response(path, raw, response)

    no_request_gets_a_5xx()
    assert httpx.get(server.url + "/health", timeout=10.0).status_code == 200
    wait_idle(server)  # nothing running or queued, every KV page back
    logged = server.log()[log_start:]
    assert "Traceback" not in logged, logged[-4000:]
