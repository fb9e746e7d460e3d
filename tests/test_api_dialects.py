"""The API dialects beside chat completions, on real servers: OpenAI's Responses API
(/v1/responses), Anthropic's Messages API (/v1/messages) and vLLM's /tokenize, /detokenize.

The oracles: each vendor SDK's own pydantic models, validated strictly (every response and
every stream event); the chat endpoint, which must give the same prompt (token count) and the
same greedy reply for the conversation a request stands for; `jsonschema` for tool arguments
and JSON outputs. Server 1: the bundled SmolLM2 with --tool-call-parser hermes.
Server 2: a tiny random Qwen3 (real tokenizer and template) with the reasoning parser.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from minisgl.api.dialects.anthropic import error_events, tool_input
from minisgl.api.dialects.responses import (
    ResponsesRequest,
    ResponseStore,
    Turn,
    list_input_items,
)
from minisgl.api.dialects.responses_items import input_items, input_messages
from minisgl.api.errors import ChoiceFailed, RequestError
from minisgl.api.pipeline import Choice, Event
from minisgl.api.sse import sse_event, stream_frames
from minisgl.chat import ChatDelta
from minisgl.core import ReqOutput, SamplingParams
from minisgl.limits import InvalidRequestError
from tests.server_utils import ServerProcess, running_server, wait_idle

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 120.0
EVENT = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(hermes_server: ServerProcess) -> ServerProcess:
    return hermes_server


def create(server: ServerProcess, **body: Any) -> dict[str, Any]:
    """POST /v1/responses (not streamed); the body is checked against the SDK's model."""
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    Response.model_validate(reply.json())
    return reply.json()


def named_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST `path` with stream: the events (`event:` line, then `data:`), the kinds agreeing."""
    reply = httpx.post(server.url + path, json={**body, "stream": True}, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    events = []
    for block in reply.text.strip().split("\n\n"):
        kind_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event['type']}"
        events.append(event)
    return events


def stream(server: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    """POST /v1/responses with stream: the events, each checked against the SDK's models."""
    events = named_events(server, "/v1/responses", body)
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def check_event_order(events: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's sequence: created, in_progress, per item added ... done, then the end; the
    deltas of each item add up to its done text. Returns the final response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert kinds.count("response.output_item.added") == len(final["output"])
    assert kinds.count("response.output_item.done") == len(final["output"])
    text: dict[str, str] = {}
    for event in events:
        if event["type"].endswith(".delta"):
            text[event["item_id"]] = text.get(event["item_id"], "") + event["delta"]
        elif event["type"] in ("response.output_text.done", "response.reasoning_text.done"):
            assert text.get(event["item_id"], "") == event["text"]
        elif event["type"] == "response.function_call_arguments.done":
            assert text.get(event["item_id"], "") == event["arguments"]
        elif event["type"] == "response.output_item.done":
            assert event["item"] == final["output"][event["output_index"]]
    return final


def test_text_reply_matches_chat_streamed_or_not(server: ServerProcess):
    body = {"model": MODEL, "input": "Say hello in French.", "instructions": "Be brief."}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello in French."},
    ]
    for max_tokens in (12, 200):
        whole = create(server, **body, max_output_tokens=max_tokens, temperature=0)
        streamed = check_event_order(
            stream(server, **body, max_output_tokens=max_tokens, temperature=0)
        )
        reference = chat(server, messages=messages, max_tokens=max_tokens, temperature=0)
        choice = reference["choices"][0]
        for response in (whole, streamed):
            assert output_text(response) == choice["message"]["content"]
            assert response["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
            assert response["usage"]["output_tokens"] == reference["usage"]["completion_tokens"]
            if choice["finish_reason"] == "length":
                assert response["status"] == "incomplete"
                assert response["incomplete_details"] == {"reason": "max_output_tokens"}
                assert response["output"][-1]["status"] == "incomplete"
            else:
                assert response["status"] == "completed" and response["incomplete_details"] is None
            assert response["instructions"] == "Be brief." and response["temperature"] == 0
    assert choice["finish_reason"] == "stop"  # the 200-token reply ended by itself
    # input as message items (text parts, a developer role) is the same conversation
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say hello in French."}]},
    ]
    as_items = create(server, model=MODEL, input=items, max_output_tokens=200, temperature=0)
    assert output_text(as_items) == choice["message"]["content"]
    wait_idle(server)


def test_previous_response_id_get_and_delete(server: ServerProcess):
    first = create(
        server, model=MODEL, input="Name a color.", instructions="Answer in one word.",
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    second = create(
        server, model=MODEL, input="Name another one.", previous_response_id=first["id"],
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert second["previous_response_id"] == first["id"]
    # instructions are not carried over (OpenAI): the conversation is the two turns
    messages = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "Name another one."},
    ]
    reference = chat(server, messages=messages, max_tokens=16, temperature=0)
    assert second["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
    assert output_text(second) == reference["choices"][0]["message"]["content"]
    # a streamed reply is stored too, and continues the same way
    streamed = stream(
        server, model=MODEL, input="Name another one.", previous_response_id=first["id"],
        max_output_tokens=16, temperature=0,
    )[-1]["response"]  # fmt: skip
    assert output_text(streamed) == output_text(second)
    got = httpx.get(f"{server.url}/v1/responses/{streamed['id']}", timeout=TIMEOUT_S)
    assert got.status_code == 200 and got.json() == streamed
    deleted = httpx.delete(f"{server.url}/v1/responses/{first['id']}", timeout=TIMEOUT_S)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{server.url}/v1/responses/{first['id']}", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["message"]
    missing = httpx.post(
        server.url + "/v1/responses",
        json={"model": MODEL, "input": "Hi", "previous_response_id": first["id"]},
        timeout=TIMEOUT_S,
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"
    # the input items, as the SDK lists them (this request's input; newest first by default)
    items = TypeAdapter(ResponseItemList)
    listed = httpx.get(f"{server.url}/v1/responses/{second['id']}/input_items", timeout=10)
    assert listed.status_code == 200
    items.validate_python(listed.json())
    [item] = listed.json()["data"]
    assert item["role"] == "user" and item["content"] == [
        {"type": "input_text", "text": "Name another one."}
    ]
    # a bad query parameter is a 400 naming it
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")):
        url = f"{server.url}/v1/responses/{second['id']}/input_items?{query}"
        refused = httpx.get(url, timeout=10)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    wait_idle(server)
    # store false: nothing kept
    unstored = create(server, model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored['id']}").status_code == 404
    wait_idle(server)


def test_function_calls_and_their_outputs(server: ServerProcess):
    question = "What is the weather in Paris?"
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        for streamed in (False, True):
            body = {
                "model": MODEL, "input": question, "tools": TOOLS, "tool_choice": choice,
                "max_output_tokens": 64, "temperature": 0,
            }  # fmt: skip
            if streamed:
                response = check_event_order(stream(server, **body))
            else:
                response = create(server, **body)
            calls = [item for item in response["output"] if item["type"] == "function_call"]
            assert calls and response["status"] == "completed", response
            for call in calls:
                assert call["name"] == "get_weather" and call["call_id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    # the round trip: the call and its output as input items, as a client sends them back
    call = calls[0]
    items: list[dict[str, Any]] = [
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C, sunny"},
    ]  # fmt: skip
    answer = create(
        server, model=MODEL, input=items, tools=TOOLS, max_output_tokens=24, temperature=0
    )
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call["call_id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "18 C, sunny"},
    ]  # fmt: skip
    reference = chat(server, messages=messages, tools=CHAT_TOOLS, max_tokens=24, temperature=0)
    assert answer["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
    assert output_text(answer) == (reference["choices"][0]["message"]["content"] or "")
    wait_idle(server)


def test_json_schema_format_and_logprobs(server: ServerProcess):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    text_format = {"format": {"type": "json_schema", "name": "person", "schema": schema}}
    body = {
        "model": MODEL, "input": "Describe a person as JSON.", "text": text_format,
        "max_output_tokens": 48, "temperature": 0,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
    }  # fmt: skip
    whole = create(server, **body)
    assert whole["status"] == "completed" and whole["text"] == text_format
    jsonschema.validate(json.loads(output_text(whole)), schema)
    part = whole["output"][0]["content"][0]
    # every token but the end-of-sequence one, which has no text
    assert len(part["logprobs"]) == whole["usage"]["output_tokens"] - 1
    assert all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    events = stream(server, **body)
    final = check_event_order(events)
    assert output_text(final) == output_text(whole)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert sum(len(e["logprobs"]) for e in deltas) == len(part["logprobs"])
    wait_idle(server)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"temperature": -1}, "temperature"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"top_logprobs": 99}, "top_logprobs"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
        ({"input": "hello " * 1500}, "input"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server: ServerProcess, body: dict, param: str):
    reply = httpx.post(
        server.url + "/v1/responses",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, **body},
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert create(server, model=MODEL, input="Hi", max_output_tokens=2)["status"] == "incomplete"


# ---- Anthropic's Messages API ----------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]


def message(server: ServerProcess, **body: Any) -> dict[str, Any]:
    """POST /v1/messages (not streamed); the body is checked against the SDK's model."""
    reply = httpx.post(server.url + "/v1/messages", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    Message.model_validate(reply.json())
    return reply.json()


def message_stream(server: ServerProcess, **body: Any) -> dict[str, Any]:
    """POST /v1/messages with stream: every event checked against the SDK's models and the
    order Anthropic sends them in; returns the message the events build."""
    events = named_events(server, "/v1/messages", body)
    for event in events:
        if event["type"] != "ping":
            ANTHROPIC_EVENT.validate_python(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    built = events[0]["message"]
    partial_json: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(built["content"])
            built["content"].append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = built["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                partial_json[event["index"]] = partial_json.get(event["index"], "")
                partial_json[event["index"]] += delta["partial_json"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                block[key] += delta[key]
        elif event["type"] == "message_delta":
            built.update(event["delta"])
            built["usage"] = event["usage"]
    for index, text in partial_json.items():
        built["content"][index]["input"] = json.loads(text)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    Message.model_validate(built)
    return built


def content_text(reply: dict[str, Any], kind: str = "text") -> str:
    return "".join(block[kind] for block in reply["content"] if block["type"] == kind)


def test_messages_match_chat_streamed_or_not(server: ServerProcess):
    body = {
        "model": MODEL, "system": "Be brief.", "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello in French."}],
    }  # fmt: skip
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello in French."},
    ]
    for max_tokens in (12, 200):
        whole = message(server, **body, max_tokens=max_tokens)
        streamed = message_stream(server, **body, max_tokens=max_tokens)
        reference = chat(server, messages=chat_messages, max_tokens=max_tokens, temperature=0)
        choice, usage = reference["choices"][0], reference["usage"]
        for reply in (whole, streamed):
            assert content_text(reply) == choice["message"]["content"]
            # Anthropic counts cached prompt tokens apart from input_tokens
            total = reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"]
            assert total == usage["prompt_tokens"]
            assert reply["usage"]["output_tokens"] == usage["completion_tokens"]
            expected = "max_tokens" if choice["finish_reason"] == "length" else "end_turn"
            assert reply["stop_reason"] == expected and reply["stop_sequence"] is None
    assert choice["finish_reason"] == "stop"
    stopped = message(
        server, model=MODEL, max_tokens=64, temperature=0, stop_sequences=["."],
        messages=[{"role": "user", "content": "Tell me about Paris."}],
    )  # fmt: skip
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "."
    assert "." not in content_text(stopped)
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=TIMEOUT_S)
    MessageTokensCount.model_validate(counted.json())
    assert counted.json() == {"input_tokens": usage["prompt_tokens"]}
    wait_idle(server)


def test_messages_tool_use_and_results(server: ServerProcess):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        body = {
            "model": MODEL, "messages": question, "tools": ANTHROPIC_TOOLS,
            "tool_choice": choice, "max_tokens": 64, "temperature": 0,
        }  # fmt: skip
        for reply in (message(server, **body), message_stream(server, **body)):
            uses = [block for block in reply["content"] if block["type"] == "tool_use"]
            assert uses and reply["stop_reason"] == "tool_use", reply
            for use in uses:
                assert use["name"] == "get_weather" and use["id"].startswith("toolu_")
                jsonschema.validate(use["input"], WEATHER)
    use = uses[0]
    conversation = [
        *question,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use["id"],
                                           "name": use["name"], "input": use["input"]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                      "content": "18 C, sunny"}]},
    ]  # fmt: skip
    answer = message(
        server, model=MODEL, messages=conversation, tools=ANTHROPIC_TOOLS, max_tokens=24,
        temperature=0,
    )  # fmt: skip
    chat_conversation = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": use["id"], "type": "function",
             "function": {"name": use["name"], "arguments": json.dumps(use["input"])}}]},
        {"role": "tool", "tool_call_id": use["id"], "content": "18 C, sunny"},
    ]  # fmt: skip
    reference = chat(
        server, messages=chat_conversation, tools=CHAT_TOOLS, max_tokens=24, temperature=0
    )
    total = answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
    assert total == reference["usage"]["prompt_tokens"]
    assert content_text(answer) == (reference["choices"][0]["message"]["content"] or "")
    wait_idle(server)


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"max_tokens": None}, 400, "invalid_request_error"),
        ({"messages": []}, 400, "invalid_request_error"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         400, "invalid_request_error"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "invalid_request_error"),
        ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error"),
        ({"temperature": -1}, 400, "invalid_request_error"),
        ({"max_tokens": 10**6}, 400, "invalid_request_error"),
        ({"model": "no-such-model"}, 404, "not_found_error"),
    ],
)  # fmt: skip
def test_messages_errors_have_anthropics_shape(
    server: ServerProcess, body: dict, status: int, kind: str
):
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    request.update(body)
    reply = httpx.post(server.url + "/v1/messages", json=request, timeout=TIMEOUT_S)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    assert error["error"]["type"] == kind and error["error"]["message"]


def test_anthropic_error_shapes_in_process():
    body = {"error": {"message": "no", "type": "x", "param": None, "code": 401}}
    error = RequestError(401, "no", err_type="x")
    assert json.loads(error.response("/v1/chat/completions").body) == body
    shaped = json.loads(error.response("/v1/messages").body)
    assert shaped == {"type": "error", "error": {"type": "authentication_error", "message": "no"}}
    [error] = error_events({"error": {"message": "boom", "code": None}})
    event = sse_event(error, named=True)
    assert event.startswith("event: error\n")
    assert json.loads(event.split("data: ")[1])["error"] == {"type": "api_error", "message": "boom"}
    assert tool_input('{"a": 1}') == {"a": 1} and tool_input("") == {}
    assert tool_input("[1]") == {"_raw_arguments": "[1]"}


# ---- /tokenize and /detokenize (vLLM's) -----------------------------------------------------


def test_tokenize_counts_what_a_request_costs(server: ServerProcess):
    def post(path: str, **body: Any) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=TIMEOUT_S)

    prompt = "The history of Paris began"
    tokens = post("/tokenize", prompt=prompt, return_token_strs=True).json()
    completion = post("/v1/completions", prompt=prompt, max_tokens=1).json()
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    assert "".join(tokens["token_strs"]) == prompt and tokens["max_model_len"] == 1024
    assert post("/detokenize", tokens=tokens["tokens"]).json() == {"prompt": prompt}
    for extra in ({}, {"tools": CHAT_TOOLS}):
        counted = post("/tokenize", messages=[{"role": "user", "content": prompt}], **extra)
        reference = chat(
            server, messages=[{"role": "user", "content": prompt}], max_tokens=1, **extra
        )
        assert counted.json()["count"] == reference["usage"]["prompt_tokens"], extra
        assert counted.json()["token_strs"] is None
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
        ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, "messages"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        reply = post(path, **body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


# ---- reasoning (Qwen3) ----------------------------------------------------------------------


THINKING_OFF = "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
THINKING_ON = THINKING_OFF.replace("{%- endif %}", "{%- else %}{{- '<think>\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen3_server(tiny_qwen3: Path, tmp_path_factory):
    # Qwen3's template with the generation prompt opening <think> (as thinking-only models'
    # templates do), so that a random model's reply is reasoning until the token budget ends.
    template = AutoTokenizer.from_pretrained(str(tiny_qwen3)).chat_template
    assert THINKING_OFF in template
    path = tmp_path_factory.mktemp("template") / "qwen3_thinking.jinja"
    path.write_text(template.replace(THINKING_OFF, THINKING_ON))
    with running_server(
        "--model", str(tiny_qwen3), "--chat-template", str(path),
        "--reasoning-parser", "auto", "--max-model-len", "512",
    ) as srv:  # fmt: skip
        yield srv


def test_reasoning_items_match_chat_reasoning(qwen3_server: ServerProcess):
    body = {"input": "Hi", "temperature": 0}  # no model: the one served
    messages = [{"role": "user", "content": "Hi"}]
    whole = create(qwen3_server, **body, max_output_tokens=24)
    streamed = check_event_order(stream(qwen3_server, **body, max_output_tokens=24))
    reference = chat(qwen3_server, messages=messages, max_tokens=24, temperature=0)
    expected = reference["choices"][0]["message"]
    for response in (whole, streamed):
        reasoning = [item for item in response["output"] if item["type"] == "reasoning"]
        assert reasoning, response  # a random model does not close its <think> in 24 tokens
        assert reasoning[0]["content"][0]["text"] == expected["reasoning_content"]
        assert output_text(response) == (expected["content"] or "")
        details = reference["usage"]["completion_tokens_details"]
        assert response["usage"]["output_tokens_details"] == details
    # the same reasoning as an Anthropic thinking block
    thinking = message(
        qwen3_server, messages=messages, max_tokens=24, temperature=0,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )  # fmt: skip
    assert [block["type"] for block in thinking["content"]][0] == "thinking"
    assert content_text(thinking, "thinking") == expected["reasoning_content"]
    # effort "none" switches Qwen3's thinking off in the template, as enable_thinking=false
    off = create(qwen3_server, **body, max_output_tokens=8, reasoning={"effort": "none"})
    reference = chat(
        qwen3_server, messages=messages, max_tokens=8, temperature=0,
        chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    assert off["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
    # ... as OpenAI's chat field reasoning_effort does on /v1/chat/completions
    effort_off = chat(qwen3_server, messages=messages, max_tokens=8, temperature=0,
                      reasoning_effort="none")  # fmt: skip
    assert effort_off["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert [item["type"] for item in off["output"]] == ["message"]
    assert output_text(off) == reference["choices"][0]["message"]["content"]
    wait_idle(qwen3_server)


# ---- in-process: translation and store ------------------------------------------------------


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "2"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ]  # fmt: skip
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool",
                                             "assistant"]  # fmt: skip
    calls = messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"]
    assert messages[2]["reasoning_content"] == "Call the tool."
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "2"}
    assert "reasoning_content" not in messages[5]
    with pytest.raises(InvalidRequestError, match=r"input\[0\]"):
        input_messages([{"role": "tool", "content": "x"}])


def test_input_items_list_in_openais_shapes():
    given = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ]  # fmt: skip
    items = input_items(given)
    assert len({item["id"] for item in items}) == len(given)
    store = ResponseStore()
    store.put({"id": "r1"}, [], items)
    page = list_input_items(store, "r1", limit=4, order="asc", after=None)
    TypeAdapter(ResponseItemList).validate_python(page)
    assert [item["id"] for item in page["data"]] == [item["id"] for item in items[:4]]
    assert page["has_more"] and page["last_id"] == items[3]["id"]
    rest = list_input_items(store, "r1", 4, "asc", page["last_id"])
    assert [item["id"] for item in rest["data"]] == [item["id"] for item in items[4:]]
    assert not rest["has_more"]
    newest = list_input_items(store, "r1", 20, "desc", None)
    assert newest["data"] == items[::-1]
    assert items[-1]["content"] == [{"type": "input_text", "text": "Go on."}]
    with pytest.raises(RequestError) as caught:
        list_input_items(store, "r1", 5, "asc", "nope")
    assert caught.value.param == "after"


def test_store_is_bounded_by_count_and_size():
    store = ResponseStore(max_entries=2, max_chars=10_000)
    for i in range(3):
        store.put({"id": f"r{i}"}, [], [])
    assert list(store._entries) == ["r1", "r2"]
    store.put({"id": "big", "text": "x" * 6000}, [], [])
    store.put({"id": "big2", "text": "x" * 6000}, [], [])  # the two do not fit together
    assert "big" not in store._entries and "big2" in store._entries
    store.put({"id": "huge", "text": "x" * 20_000}, [], [])  # larger than the store: not kept
    assert "huge" not in store._entries and "big2" in store._entries


def test_a_stream_that_fails_ends_with_error_and_response_failed():
    """The path a stream takes when a choice fails mid-way (ChoiceFailed, as a timeout or a
    backend error would end it): what the client reads still parses as OpenAI's events."""
    store = ResponseStore()
    choice = Choice(0, 0, "resp_1-0-0", None)

    async def outputs():
        yield Event(choice, ReqOutput(choice.rid, (1,), text="Hel"), ChatDelta(content="Hel"))
        raise ChoiceFailed("the request failed in the scheduler")

    run = SimpleNamespace(
        id="resp_1",
        ctx=None,
        model_name=MODEL,
        params=[SamplingParams()],
        events=outputs,
        close=lambda: None,
    )
    body = ResponsesRequest.model_validate({"input": "Hi", "stream": True})
    turn = Turn(body, run, [])  # type: ignore[arg-type]

    async def read() -> list[str]:
        frames = stream_frames(run, turn.wire_events(store), turn.error_events)  # type: ignore[arg-type]
        return [frame async for frame in frames]

    blocks = asyncio.run(read())
    parsed = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in blocks]
    for event in parsed:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    error, failed = parsed[-2:]
    assert error["type"] == "error" and "scheduler" in error["message"]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    assert failed["response"]["output"][0]["content"][0]["text"] == "Hel"
    assert run.id not in store._entries  # a failed response is not stored
