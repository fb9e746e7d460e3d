"""Anthropic's Messages API, as vLLM and llama.cpp serve it: POST /v1/messages and
/v1/messages/count_tokens, errors in Anthropic's shape under /v1/messages. A request runs as a
chat; the reply's blocks become `thinking`, `text` and `tool_use` content blocks streamed as
Anthropic's events, whose fold (`fold_message`) is the non-streaming reply.
docs/server.md#anthropics-messages-api is the reference."""

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from minisgl.api.errors import ERROR_SHAPES
from minisgl.api.pipeline import Choice, Run
from minisgl.api.request import (
    ApiRequest,
    ChatWire,
    JsonObject,
    chat_tool_choice,
    chat_tools,
    function_call,
    invalid_at,
    new_id,
    sampling_of,
)
from minisgl.api.sse import EventBuffer, respond
from minisgl.chat import CALL, REASONING, ChatPrompt, ReplyBlocks, jsontext
from minisgl.chat.template import text_content
from minisgl.chat.tool_parsers import ToolCallDelta
from minisgl.core import FinishReason
from minisgl.limits import InvalidRequestError

PATH_PREFIX = "/v1/messages"
ALIASES = {"stop_sequences": "stop", "metadata.user_id": "user"}
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(status_code: Any, message: str) -> JsonObject:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status_code, "api_error"), "message": message},
    }


ERROR_SHAPES[PATH_PREFIX] = anthropic_error


class MessagesRequest(ChatWire):
    messages: list[Any]
    max_tokens: int  # required, as Anthropic has it
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    tool_choice: JsonObject | None = None
    thinking: JsonObject | None = None
    metadata: JsonObject | None = None

    def to_api(self) -> ApiRequest:
        text = text_content(self.system or "", "system", "system")
        system = [{"role": "system", "content": text}] if text else []
        kwargs = dict(self.chat_template_kwargs or {})
        if (thinking := (self.thinking or {}).get("type")) in ("enabled", "disabled"):
            kwargs.setdefault("enable_thinking", thinking == "enabled")
        prompt = ChatPrompt(
            system + chat_messages(self.messages),
            chat_tools(self.tools, "custom", TOOL_KEYS, "custom"),
            chat_tool_choice(self.tool_choice, "tool", TOOL_CHOICES, EXPECTED_TOOL_CHOICE),
            not (self.tool_choice or {}).get("disable_parallel_tool_use"),
            kwargs or None,
        )
        user = (self.metadata or {}).get("user_id")  # the tenant (--tenant-fairness)
        return ApiRequest(prompt, *sampling_of(self, ALIASES, user=user), model=self.model)


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages request without the budget."""

    max_tokens: int = 1


def _tool_call(block: Mapping[str, Any], where: str) -> JsonObject:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise invalid_at(where, "a tool_use block needs an id and a name")
    if not isinstance(arguments, Mapping):
        raise invalid_at(where, "a tool_use block's input must be an object")
    return function_call(call_id, name, json.dumps(arguments, ensure_ascii=False))


def chat_messages(messages: list[Any]) -> list[JsonObject]:
    """Anthropic messages -> chat messages."""
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    out: list[JsonObject] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise invalid_at(where, "must be an object with role user or assistant and content")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise invalid_at(where, "content must be text or a list of content blocks")
        entry: JsonObject = {"role": role, "content": ""}
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                entry["content"] += block["text"]
            elif kind == "tool_use" and role == "assistant":
                entry.setdefault("tool_calls", []).append(_tool_call(block, at))
            elif kind == "tool_result" and role == "user":
                if not isinstance(call_id := block.get("tool_use_id"), str):
                    raise invalid_at(at, "a tool_result block needs a tool_use_id")
                result = text_content(block.get("content", ""), at, "messages")
                out.append({"role": "tool", "tool_call_id": call_id, "content": result})
            elif kind == "thinking" and role == "assistant":
                thought = str(block.get("thinking", ""))
                entry["reasoning_content"] = entry.get("reasoning_content", "") + thought
            elif kind in ("image", "document"):
                raise invalid_at(at, f"{kind} blocks are not supported: the model reads text")
            # redacted_thinking: encrypted by Anthropic's models; nothing a local model can read
            elif kind != "redacted_thinking" or role != "assistant":
                raise invalid_at(at, f"a {kind!r} block is not supported in a {role} message")
        if role == "user" and not entry["content"] and out and out[-1]["role"] == "tool":
            continue  # only tool results: they are the turn
        out.append(entry)
    return out


# Anthropic's tool fields -> chat's function's
TOOL_KEYS = {"name": "name", "description": "description", "input_schema": "parameters"}


# Anthropic's tool_choice types -> chat's (a named tool: {"type": "tool", "name"}).
TOOL_CHOICES = {"auto": "auto", "none": "none", "any": "required"}
EXPECTED_TOOL_CHOICE = "{'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name'}"


def tool_input(arguments: str) -> JsonObject:
    """A call's arguments as the object Anthropic's `input` is; text that is not a JSON object
    (a model's broken call) is kept whole under `_raw_arguments` rather than lost."""
    value = jsontext.loads_object(arguments) if arguments.strip() else {}
    return {"_raw_arguments": arguments} if value is None else value


# A block's kind -> its delta's type and the key its text goes under.
_DELTAS = {
    REASONING: ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
    CALL: ("input_json_delta", "partial_json"),
}
_DELTA_KEYS = dict(_DELTAS.values())
_EMPTY_BLOCKS = {
    REASONING: {"type": "thinking", "thinking": "", "signature": ""},  # nothing signs ours
    "text": {"type": "text", "text": ""},
}


class BlockEvents(EventBuffer):
    """The reply's blocks as Anthropic's stream events (a minisgl.chat.output.BlockSink)."""

    _index = -1

    def open(self, kind: str, call: ToolCallDelta | None) -> None:
        self._index += 1
        block = (  # copied by the emit
            _EMPTY_BLOCKS[kind]
            if call is None
            else {
                "type": "tool_use",
                "id": new_id("toolu", "_"),
                "name": call.name or "",
                "input": {},
            }
        )
        self.emit("content_block_start", index=self._index, content_block=block)

    def write(self, kind: str, text: str, logprobs: list[Any]) -> None:
        delta_type, key = _DELTAS[kind]
        if text or kind != CALL:
            self.emit(
                "content_block_delta", index=self._index, delta={"type": delta_type, key: text}
            )

    def close(self, status: str) -> None:
        self.emit("content_block_stop", index=self._index)


def stop_reason(choice: Choice, num_calls: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence (stop strings are only the request's own)."""
    if choice.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(choice.matched_stop, str):
        return "stop_sequence", choice.matched_stop
    return "end_turn", None


async def message_events(run: Run) -> AsyncIterator[JsonObject]:
    sink = BlockEvents()
    blocks = ReplyBlocks(sink)
    sink.emit(
        "message_start",
        message={
            "id": run.id,
            "type": "message",
            "role": "assistant",
            "model": run.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(run.prompts[0]), "output_tokens": 0},
        },
    )
    sink.emit("ping")
    async for event in run.events():
        blocks.feed(event.delta)
        for wire_event in sink.take():
            yield wire_event
    blocks.finish()
    reason, sequence = stop_reason(run.choices[0], blocks.num_calls)
    prompt, completion, cached = run.usage()
    usage = {
        # Anthropic counts prompt tokens read from the cache apart from `input_tokens`.
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }
    sink.emit(
        "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage
    )
    sink.emit("message_stop")
    for wire_event in sink.take():
        yield wire_event


def fold_message(events: list[JsonObject]) -> JsonObject:
    """A message stream's events as the one message of a non-streaming reply."""
    message = events[0]["message"]  # the events are this fold's own copies
    blocks: list[JsonObject] = []
    for event in events:
        kind = event["type"]
        if kind == "content_block_start":
            blocks.append(event["content_block"])
        elif kind == "content_block_delta":  # a call's arguments gather under partial_json
            key = _DELTA_KEYS[event["delta"]["type"]]
            block = blocks[event["index"]]
            block[key] = block.get(key, "") + event["delta"][key]
        elif kind == "content_block_stop" and blocks[event["index"]]["type"] == "tool_use":
            block = blocks[event["index"]]
            block["input"] = tool_input(block.pop("partial_json", ""))
        elif kind == "message_delta":
            message |= {**event["delta"], "usage": event["usage"]}
    return {**message, "content": blocks}


def error_events(body: JsonObject) -> list[JsonObject]:
    """A stream that fails ends with Anthropic's error event."""
    return [anthropic_error(body["error"].get("code"), body["error"]["message"])]


router = APIRouter()


@router.post(PATH_PREFIX)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    run = await Run(request, body.to_api(), new_id("msg", "_")).start()
    return await respond(run, message_events(run), body.stream, fold_message, error_events)


@router.post(f"{PATH_PREFIX}/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> JsonObject:
    request.app.state.ctx.check_model(body.model)
    run = Run(request, body.to_api())
    await run.tokenize()
    return {"input_tokens": len(run.prompts[0])}
