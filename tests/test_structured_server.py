"""Structured outputs, tool calls and reasoning through the real server and the OpenAI SDK.

Server 1: the bundled SmolLM2 with --tool-call-parser hermes. Every constrained reply is
checked by the oracle that matters to clients: `jsonschema` validates it, the regex matches it,
the tool call's arguments validate against the tool's own schema. Server 2: a tiny random
Qwen3 with the real Qwen3 tokenizer and template, --chat-template (a file),
--chat-template-kwargs and auto-detected parsers; its prompts are checked against
transformers' rendering.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from tests.server_utils import (
    ServerProcess,
    openai_client,
    start_server,
    wait_idle,
)

MODEL = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 180.0
# SmolLM2 answers these schemas greedily in at most ~52 tokens; a number may run longer.
MAX_TOKENS = 96
NUM_WORKERS = 20
USER = [{"role": "user", "content": "Describe a fictional person as JSON."}]

STR = {"type": "string", "maxLength": 8}


def obj(required: list[str] | None = None, **properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def enum(*values: object) -> dict:
    return {"enum": list(values)}


def array(items: dict, low: int, high: int) -> dict:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


BOOL = {"type": "boolean"}
# Nested objects, arrays, enums, required fields, numbers with bounds; strings are bounded so
# that a 135M model finishes each within MAX_TOKENS.
SCHEMAS: list[dict] = [
    obj(name=STR, age=integer(0, 120)),
    obj(color=enum("red", "green", "blue")),
    obj(ok=BOOL, note={"type": "null"}),
    obj(score={"type": "number", "minimum": 0, "maximum": 10}),
    obj(temp=integer(-40, 50)),
    obj(tags=array(enum("a", "b", "c"), 1, 3)),
    obj(point=obj(x=integer(0, 9), y=integer(0, 9))),
    obj(id={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    obj(kind={"const": "cat"}, lives=integer(1, 9)),
    array(integer(0, 99), 2, 4),
    obj(value={"anyOf": [integer(0, 5), BOOL]}),
    obj(user=obj(name=STR, admin=BOOL), active=BOOL),
    obj(matrix=array(array(integer(0, 9), 2, 2), 2, 2)),
    obj(status=enum("open", "closed"), count=integer(0, 1000)),
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    obj(title=STR, pages=integer(1, 999), fiction=BOOL),
    obj(ratio={"type": "number", "minimum": -1, "maximum": 1}),
    obj(items=array(obj(sku=enum("x1", "x2"), qty=integer(1, 5)), 1, 2)),
    obj(["a"], a=integer(0, 3), b=integer(0, 3)),
    integer(10, 20),
]
WEATHER = {
    "type": "object",
    "properties": {"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(hermes_server: ServerProcess) -> ServerProcess:
    return hermes_server  # a missing or broken bundled model fails there, loudly


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, REQUEST_TIMEOUT_S)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _constrained(client: openai.OpenAI, schema: dict, stream: bool) -> tuple[str, str | None]:
    kwargs = dict(
        model=MODEL,
        messages=USER,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=_schema_format(schema),
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_twenty_json_schemas_streaming_and_not(server: ServerProcess, client: openai.OpenAI):
    jobs = [(schema, stream) for schema in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        replies = list(pool.map(lambda job: _constrained(client, *job), jobs))
    for (schema, stream), (text, finish) in zip(jobs, replies, strict=True):
        assert finish == "stop", (schema, stream, text)
        jsonschema.validate(json.loads(text), schema)
    wait_idle(server)


def test_json_object_regex_and_choice(server: ServerProcess, client: openai.OpenAI):
    def json_object(max_tokens: int) -> tuple[str, str | None, int]:
        reply = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert reply.usage is not None
        choice = reply.choices[0]
        return choice.message.content or "", choice.finish_reason, reply.usage.completion_tokens

    # Room enough: the grammar ends the object (SmolLM2 closes it after ~75 tokens) ...
    text, finish, num_tokens = json_object(MAX_TOKENS)
    assert finish == "stop" and num_tokens < MAX_TOKENS, (finish, text)
    assert isinstance(json.loads(text), dict)
    # ... and cut short, the same greedy reply stops at max_tokens: a prefix of that object
    cut, finish, num_tokens = json_object(16)
    assert finish == "length" and num_tokens == 16
    assert text.startswith(cut) and len(cut) < len(text)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    body = {"prompt": "Call me at", "regex": phone, "max_tokens": 24, "temperature": 0}
    completion = httpx.post(server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert completion.status_code == 200
    assert re.fullmatch(phone, completion.json()["choices"][0]["text"])
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )  # fmt: skip
    assert chat.choices[0].message.content in ("alpha", "beta")
    assert chat.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens


def test_n_logprobs_stop_and_usage_with_a_schema(client: openai.OpenAI):
    schema = SCHEMAS[0]
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2,
        logprobs=True, top_logprobs=2, response_format=_schema_format(schema),
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        assert choice.logprobs is not None and len(choice.logprobs.content or []) > 0
    assert reply.usage is not None
    assert reply.usage.completion_tokens >= sum(
        len(c.logprobs.content or []) for c in reply.choices if c.logprobs
    )
    # a stop string still ends a constrained reply (before the grammar does)
    stopped = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=MAX_TOKENS, temperature=0, stop=[","],
        response_format=_schema_format(schema),
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert "," not in (stopped.choices[0].message.content or "")


def _check_calls(calls: list, max_calls: int | None = None) -> None:
    assert calls and (max_calls is None or len(calls) <= max_calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(client: openai.OpenAI):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for parallel in (True, False):
        reply = client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=MAX_TOKENS, temperature=0,
            tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls or [], None if parallel else 1)
    named = {"type": "function", "function": {"name": "get_time"}}
    deltas = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=MAX_TOKENS, temperature=0,
        tools=TOOLS, tool_choice=named, stream=True,
    ):  # fmt: skip
        if chunk.choices:
            deltas.append(chunk.choices[0])
    first = next(d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls)
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == "get_time"
    for d in deltas:  # one entry per call in a chunk: tool_calls[0] holds all of call 0's part
        indices = [call.index for call in d.delta.tool_calls or []]
        assert len(indices) == len(set(indices)), d.delta.tool_calls
    arguments = "".join(
        call.function.arguments or "" for d in deltas for call in d.delta.tool_calls or []
    )
    jsonschema.validate(json.loads(arguments), TIME)
    assert deltas[-1].finish_reason == "tool_calls"


def test_tool_round_trip_and_parse_with_pydantic(client: openai.OpenAI):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.chat.completions.create(
        model=MODEL, messages=[question], max_tokens=MAX_TOKENS, temperature=0,
        tools=TOOLS, tool_choice="required",
    )  # fmt: skip
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        question,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=16, temperature=0, tools=TOOLS
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        population: int = pydantic.Field(ge=0, le=99_999_999)

    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
        max_tokens=MAX_TOKENS, temperature=0, response_format=City,
    )  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, City)


def _function(**function: object) -> list[dict]:
    return [{"type": "function", "function": function}]


BAD_REQUESTS = [
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": _function(parameters={})}, "tools"),  # no name
    (
        {"tools": _function(name="f", parameters={"type": "foo"}), "tool_choice": "required"},
        "tools",
    ),
    ({"response_format": _schema_format({"type": "foo"})}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ({"regex": "(("}, "regex"),
    ({"chat_template_kwargs": {"enable_thinking": False}, "ebnf": "root ::= x"}, "ebnf"),
]


def test_bad_input_is_a_400_and_the_server_keeps_serving(server: ServerProcess, client):
    for extra, param in BAD_REQUESTS:
        body = {"model": MODEL, "messages": USER, "max_tokens": 4, **extra}
        response = httpx.post(
            server.url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
        )
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"]
    bad = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}
    assert httpx.post(server.url + "/v1/completions", json=bad).status_code == 400
    # an aborted constrained stream: its pages come back, its matcher is dropped
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S,
        json={"messages": USER, "max_tokens": 200, "stream": True,
              "response_format": {"type": "json_object"}},
    ) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if '"content"' in line:
                break
    text, finish = _constrained(client, SCHEMAS[1], stream=False)
    assert finish == "stop" and json.loads(text)["color"] in ("red", "green", "blue")
    wait_idle(server)


# ---- Qwen3: template options, reasoning, auto-detected parsers --------------------------------

CUSTOM_MARK = "# Tools (custom template)"


@pytest.fixture(scope="module")
def qwen3_server(tiny_qwen3: Path, tmp_path_factory):
    template = AutoTokenizer.from_pretrained(str(tiny_qwen3)).chat_template
    path = tmp_path_factory.mktemp("template") / "qwen3.jinja"
    path.write_text(template.replace("# Tools", CUSTOM_MARK))
    srv = start_server(
        "--model", str(tiny_qwen3), "--chat-template", str(path),
        "--chat-template-kwargs", '{"enable_thinking": false}',
        "--reasoning-parser", "auto", "--tool-call-parser", "auto", "--max-model-len", "512",
    )  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv, path.read_text()
    finally:
        srv.stop()


def _chat(server: ServerProcess, **body) -> dict:
    body = {"messages": USER, "max_tokens": 12, "temperature": 0, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_qwen3_template_options_and_reasoning(qwen3_server, tiny_qwen3: Path):
    server, template = qwen3_server
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3))

    def prompt_len(**kwargs) -> int:
        ids = tokenizer.apply_chat_template(
            USER, chat_template=template, add_generation_prompt=True, tokenize=True, **kwargs
        )
        return len(ids["input_ids"])

    # the server default (enable_thinking false) reaches the template, a request overrides it
    off = _chat(server)
    assert off["usage"]["prompt_tokens"] == prompt_len(enable_thinking=False)
    on = _chat(server, chat_template_kwargs={"enable_thinking": True})
    assert on["usage"]["prompt_tokens"] == prompt_len()
    # thinking off: the reply is all content; the reasoning fields are there, empty
    message = off["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["reasoning"] is None
    # ... and the grammar applies from the first token (nothing to wait for)
    constrained = _chat(server, response_format=_schema_format(SCHEMAS[14]), max_tokens=8)
    assert json.loads(constrained["choices"][0]["message"]["content"]) in ("yes", "no", "maybe")
    assert constrained["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    # tools: the custom template renders them, auto picked the hermes parser
    with_tools = _chat(server, tools=TOOLS, max_tokens=4)
    assert with_tools["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(
            USER, tools=TOOLS, chat_template=template, add_generation_prompt=True,
            enable_thinking=False, tokenize=True,
        )["input_ids"]
    )  # fmt: skip
    # streamed deltas joined equal the non-streamed reply
    body = {"messages": USER, "max_tokens": 24, "temperature": 0, "stream": True,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    reasoning = content = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    whole = _chat(server, max_tokens=24, chat_template_kwargs={"enable_thinking": True})
    assert reasoning == (whole["choices"][0]["message"]["reasoning_content"] or "")
    assert content == (whole["choices"][0]["message"]["content"] or "")
    wait_idle(server)
