"""POST /v1/responses (OpenAI's Responses API): the request body, and its translation to a chat
request that the chat path (template, tools, reasoning, constraint, sampling) runs as it is.

What translates:
- `instructions` -> a leading system message (not carried over by `previous_response_id`, as
  OpenAI does it); `input` text -> a user message; input items -> chat messages: `message`
  (roles user, system, developer -> system, assistant; text parts), `function_call` -> an
  assistant message's `tool_calls`, `function_call_output` -> a `tool` message, `reasoning` ->
  the next assistant message's `reasoning_content`.
- `tools` (flat function tools) and `tool_choice` -> chat's nested forms; `text.format` ->
  `response_format`; `max_output_tokens` -> `max_tokens`; `reasoning.effort` -> the chat
  request's `reasoning_effort` ("none" turns Qwen3's thinking off).
- vLLM's and SGLang's sampling extras (top_k, min_p, penalties, seed, stop, ...) pass through.

What does not: built-in tools (web search, file search, computer use, MCP), images and files
in the input, `background`, `truncation: "auto"`. Each is a 400 that names the field, so a
client learns its request was not run as written.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from minisgl.core import InvalidRequestError
from minisgl.server.protocol import ChatCompletionRequest, OpenAIRequest

# Sampling fields this endpoint accepts beyond OpenAI's own (vLLM and SGLang accept them too);
# they reach the chat request unchanged.
PASS_THROUGH_FIELDS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "chat_template_kwargs",
)
INCLUDE_LOGPROBS = "message.output_text.logprobs"
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
# The chat request's field names -> this endpoint's, for the `param` of a 400.
_WIRE_NAMES = {
    "max_tokens": "max_output_tokens",
    "logprobs": "top_logprobs",
    "messages": "input",
    "response_format": "text.format",
}


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool = False
    # Pass-through extras (PASS_THROUGH_FIELDS); typed so that the chat request's checks apply.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, Any] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ResponsesRequest:
        if self.background:
            raise InvalidRequestError(
                "background", "is not supported: a response runs while its request is open"
            )
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError(
                "truncation", "only 'disabled' is supported (a prompt that is too long is a 400)"
            )
        return self

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ()) or bool(self.top_logprobs)

    @property
    def text_format(self) -> dict[str, Any]:
        """`text.format` as the response echoes it."""
        fmt = (self.text or {}).get("format")
        return dict(fmt) if isinstance(fmt, Mapping) else {"type": "text"}


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request runs as; 400s name the Responses field."""

    def wire_param(self, name: str) -> str:
        return _WIRE_NAMES.get(name, name)


def _fail(where: str, message: str, param: str = "input") -> InvalidRequestError:
    return InvalidRequestError(param, f"{where}: {message}")


def content_text(content: Any, where: str) -> str:
    """Text content: a string, or a list of text parts (input_text, output_text, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "content must be text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _fail(f"{where}.content[{j}]", f"{kind} is not supported: the model reads text")
        else:
            raise _fail(f"{where}.content[{j}]", "must be a text part {'type', 'text'}")
    return "".join(texts)


def _text_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _fail(where, f"{key} must be a string")
    return value


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` -> chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item, waiting for the assistant turn it belongs to
    previous_kind = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _fail(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _fail(where, "role must be user, system, developer or assistant")
            message = {
                "role": "system" if role == "developer" else role,
                "content": content_text(item.get("content"), where),
            }
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            arguments = _text_field(item, "arguments", where)
            call = {
                "id": _text_field(item, "call_id", where),
                "type": "function",
                "function": {"name": _text_field(item, "name", where), "arguments": arguments},
            }
            # Calls that follow an assistant turn (or each other) belong to that turn.
            if previous_kind in ("assistant", "function_call"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _text_field(item, "call_id", where),
                    "content": content_text(output, where),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = content_text(parts, where)
        else:
            raise _fail(
                where,
                f"item type {kind!r} is not supported "
                "(message, function_call, function_call_output, reasoning)",
            )
        previous_kind = item.get("role") if kind == "message" else kind
    if not messages:
        raise InvalidRequestError("input", "must hold at least one message")
    return messages


_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _text_parts(content: Any, role: str) -> list[dict[str, Any]]:
    """A message's content as OpenAI's typed parts: input_text, or output_text for the
    assistant (which carries annotations); refusals as they are."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    typed = []
    for part in parts:
        if part.get("type") == "refusal":
            typed.append(dict(part))
        elif role == "assistant":
            typed.append({"type": "output_text", "text": part["text"], "annotations": []})
        else:
            typed.append({"type": "input_text", "text": part["text"]})
    return typed


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` (already checked by `input_messages`) as the items GET
    /v1/responses/{id}/input_items lists: OpenAI's shapes, each with an id."""
    given = [{"role": "user", "content": value}] if isinstance(value, str) else value
    items = []
    for item in given:
        kind = item.get("type", "message")
        entry = {"id": item.get("id") or f"{_ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}"}
        if kind == "message":
            role = item["role"]
            content = _text_parts(item.get("content"), role)
            entry |= {"type": "message", "role": role, "content": content, "status": "completed"}
        else:
            entry |= {k: v for k, v in item.items() if k != "id"}
            if kind != "reasoning":
                entry.setdefault("status", "completed")
            else:
                entry.setdefault("summary", [])
        items.append(entry)
    return items


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat function tools -> chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise InvalidRequestError(
                "tools", f"tools[{i}]: only function tools are supported, not {kind!r}"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if function.get("parameters") is None:
            function.pop("parameters", None)  # OpenAI allows null: no parameters
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, Mapping):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError(
            "tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name'}"
        )
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format` (json_schema's fields move under one key)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError("text.format", "must be an object with a type")
    if fmt.get("type") != "json_schema":
        return dict(fmt)
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def chat_request_for(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ResponsesChatRequest, list[dict[str, Any]]]:
    """The chat request to run, and the conversation without instructions (what a later
    `previous_response_id` continues: `history` is the earlier turns')."""
    turns = [*history, *input_messages(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system + turns,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": chat_response_format(body.text),
        "chat_template_kwargs": body.chat_template_kwargs,
        "reasoning_effort": (body.reasoning or {}).get("effort"),
        "stream": body.stream,
        "user": body.user,
    }
    for name in PASS_THROUGH_FIELDS:
        if name != "chat_template_kwargs":
            fields[name] = getattr(body, name)
    return ResponsesChatRequest.model_validate(fields), turns
