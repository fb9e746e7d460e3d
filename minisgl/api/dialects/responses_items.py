"""The Responses API's items: `input` as the chat messages, tools and constraint the pipeline
runs, and as the typed items GET /v1/responses/{id}/input_items lists; the reply's blocks as
output items (`OutputItems`). What cannot be translated (images, files, built-in tools) is a
400 naming the field. docs/server.md#openais-responses-api lists the mapping."""

import copy
from collections.abc import Mapping
from typing import Any

from minisgl.api.request import JsonObject, function_call, invalid_at, new_id
from minisgl.api.sse import EventBuffer
from minisgl.chat import CALL, REASONING
from minisgl.chat.template import text_content
from minisgl.chat.tool_parsers import ToolCallDelta
from minisgl.limits import InvalidRequestError

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
# A function_call item's fields, in function_call's order.
FUNCTION_CALL_KEYS = ("call_id", "name", "arguments")
# A message item's roles: chat's, and developer (a system message).
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
FUNCTION_KEYS = {"name": "name", "description": "description", "parameters": "parameters"}


def _text_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_at(where, f"{key} must be a string")
    return value


def input_messages(value: str | list[Any]) -> list[JsonObject]:
    """`input` -> chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[JsonObject] = []
    reasoning: str | None = None  # a reasoning item, waiting for the assistant turn it belongs to
    previous_kind = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid_at(where, "must be an object")
        kind = item.get("type", "message")
        message: JsonObject | None = None
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise invalid_at(where, "role must be user, system, developer or assistant")
            content = text_content(item.get("content"), where, "input", TEXT_PART_TYPES)
            message = {"role": "system" if role == "developer" else role, "content": content}
        elif kind == "function_call":
            call = function_call(*(_text_field(item, key, where) for key in FUNCTION_CALL_KEYS))
            # Calls that follow an assistant turn (or each other) belong to that turn.
            if previous_kind in ("assistant", "function_call"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
        elif kind == "function_call_output":
            call_id = _text_field(item, "call_id", where)
            content = text_content(item.get("output"), where, "input", TEXT_PART_TYPES)
            message = {"role": "tool", "tool_call_id": call_id, "content": content}
        elif kind == "reasoning":
            given = item.get("content") or item.get("summary") or []
            reasoning = text_content(given, where, "input", TEXT_PART_TYPES)
        else:
            raise invalid_at(
                where, f"item type {kind!r} is not supported ({', '.join(ITEM_ID_PREFIXES)})"
            )
        if message is not None:
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        previous_kind = item.get("role") if kind == "message" else kind
    if not messages:
        raise InvalidRequestError("input", "must hold at least one message")
    return messages


def _text_part(part: Mapping[str, Any], role: str) -> JsonObject:
    """A text part as OpenAI types it: input_text, or output_text for the assistant (which
    carries annotations); a refusal as it is."""
    if part.get("type") == "refusal":
        return dict(part)
    if role == "assistant":
        return {"type": "output_text", "text": part["text"], "annotations": []}
    return {"type": "input_text", "text": part["text"]}


def input_items(value: str | list[Any]) -> list[JsonObject]:
    """`input` (already checked by `input_messages`) as the items GET
    /v1/responses/{id}/input_items lists: OpenAI's shapes, each with an id."""
    given: list[Any] = [{"role": "user", "content": value}] if isinstance(value, str) else value
    items = []
    for item in given:
        kind = item.get("type", "message")
        entry = {"id": item.get("id") or new_id(ITEM_ID_PREFIXES[kind], "_")}
        if kind == "message":
            role, parts = item["role"], item["content"]
            if isinstance(parts, str):
                parts = [{"type": "text", "text": parts}]
            content = [_text_part(part, role) for part in parts]
            entry |= {"type": "message", "role": role, "content": content, "status": "completed"}
        else:  # as sent, with what OpenAI fills in
            entry |= {k: v for k, v in item.items() if k != "id"}
            key, default = ("summary", []) if kind == "reasoning" else ("status", "completed")
            entry.setdefault(key, default)
        items.append(entry)
    return items


def response_format(text: JsonObject | None) -> JsonObject | None:
    """`text.format` -> chat's `response_format` (json_schema's fields move under one key)."""
    if (fmt := (text or {}).get("format")) is None:
        return None
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError("text.format", "must be an object with a type")
    if fmt.get("type") != "json_schema":
        return dict(fmt)
    return {
        "type": "json_schema",
        "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
    }


# A text block's item and its one content part (a call's item has no parts).
_TEXT_ITEMS: dict[str, tuple[JsonObject, JsonObject]] = {
    REASONING: ({"type": "reasoning", "summary": []}, {"type": "reasoning_text", "text": ""}),
    "text": (
        {"type": "message", "role": "assistant"},
        {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    ),
}


class OutputItems(EventBuffer):
    """The reply's blocks as output items, and the stream events that build them, numbered
    (a minisgl.chat.output.BlockSink)."""

    def __init__(self) -> None:
        super().__init__(numbered=True)
        self.items: list[JsonObject] = []

    def _at(self, part: bool = True) -> JsonObject:
        """Where an event about the open item (and its one content part) points."""
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        return {**where, "content_index": 0} if part else where

    def open(self, kind: str, call: ToolCallDelta | None) -> None:
        part = None
        if call is not None:
            item: JsonObject = {
                "type": "function_call",
                "call_id": new_id("call", "_"),
                "name": call.name or "",
                "arguments": "",
            }
        else:
            head, part = copy.deepcopy(_TEXT_ITEMS[kind])
            item = {**head, "content": []}
        # Every kind: an id with its type's prefix (as input items get), in progress until closed.
        item = {"id": new_id(ITEM_ID_PREFIXES[item["type"]], "_"), **item, "status": "in_progress"}
        self.items.append(item)
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if part is not None:
            item["content"].append(part)
            self.emit("response.content_part.added", **self._at(), part=part)

    def write(self, kind: str, text: str, logprobs: list[Any]) -> None:
        item = self.items[-1]
        if kind == CALL:
            item["arguments"] += text
            if text:
                self.emit("response.function_call_arguments.delta", **self._at(False), delta=text)
            return
        part = item["content"][0]
        part["text"] += text
        if kind == REASONING:
            self.emit("response.reasoning_text.delta", **self._at(), delta=text)
        else:
            part["logprobs"] += logprobs
            self.emit("response.output_text.delta", **self._at(), delta=text, logprobs=logprobs)

    def close(self, status: str) -> None:
        item = self.items[-1]
        if item["type"] == "function_call":
            done = {"name": item["name"], "arguments": item["arguments"]}  # name: OpenAI's SDK 3
            self.emit("response.function_call_arguments.done", **self._at(False), **done)
        else:
            part = item["content"][0]
            done = {key: part[key] for key in ("text", "logprobs") if key in part}
            self.emit(f"response.{part['type']}.done", **self._at(), **done)
            self.emit("response.content_part.done", **self._at(), part=part)
        item["status"] = status
        self.emit("response.output_item.done", output_index=len(self.items) - 1, item=item)

    def assistant_message(self) -> JsonObject:
        """The reply as a chat message: what a later turn's conversation holds."""
        message: JsonObject = {"role": "assistant", "content": ""}
        calls = []
        for item in self.items:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            else:
                calls.append(function_call(*(item[key] for key in FUNCTION_CALL_KEYS)))
        if calls:
            message["tool_calls"] = calls
        return message
