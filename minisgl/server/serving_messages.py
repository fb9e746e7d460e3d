"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request is translated to a chat request (minisgl.server.messages_protocol) and runs as one.
Its reply's ChatDeltas become content blocks in the order the model wrote them: `thinking`,
`text`, `tool_use` (its arguments parsed into `input`). `ContentBlocks` builds them for the
streamed and the whole message alike; a stream sends Anthropic's events (message_start, each
block's content_block_start / _delta / _stop, message_delta with the stop reason and usage,
message_stop). Errors have Anthropic's shape (minisgl.server.errors.shape_error).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.chat import ChatDelta, PreparedChat
from minisgl.chat.tool_parsers import ToolCallDelta
from minisgl.core import FinishReason, InvalidRequestError
from minisgl.server.errors import anthropic_error
from minisgl.server.generation import (
    GenerationGroup,
    ServingContext,
    stream_response,
    translated_request_error,
)
from minisgl.server.messages_protocol import MessagesChatRequest, MessagesRequest, chat_request_for
from minisgl.server.protocol import new_item_id
from minisgl.server.serving_chat import prepare_chat_request
from minisgl.server.sse import EventQueue

TEXT, THINKING, TOOL_USE = "text", "thinking", "tool_use"
_DELTA = {TEXT: ("text_delta", "text"), THINKING: ("thinking_delta", "thinking")}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; text that is not a JSON object
    (a model's broken call) is kept whole under `_raw_arguments` rather than lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


class ContentBlocks:
    """One reply's ChatDeltas -> content blocks; with `events`, also the stream events that
    build them. One block is open at a time: the next kind of output closes it."""

    def __init__(self, events: EventQueue | None = None) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._events = events
        self._open: dict[str, Any] | None = None
        self._open_call: int | None = None  # ToolCallDelta.index of the open tool_use
        self._arguments: list[str] = []  # the open tool_use's arguments so far
        self._held_text = ""  # whitespace between blocks: starts a text block only if text follows

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, **fields)

    @property
    def _index(self) -> int:
        return len(self.blocks) - 1

    def feed(self, delta: ChatDelta) -> None:
        if delta.reasoning:
            self._write(THINKING, delta.reasoning)
        if delta.content:
            self._write(TEXT, delta.content)
        for call in delta.tool_calls:
            self._write_call(call)

    def finish(self) -> None:
        if not self.blocks and self._held_text:  # a reply of only whitespace is still a reply
            self._write(TEXT, "", flush=True)
        self._close()

    @property
    def num_calls(self) -> int:
        return sum(block["type"] == TOOL_USE for block in self.blocks)

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self._close()
        self._open = block
        self.blocks.append(block)
        self._emit("content_block_start", index=self._index, content_block=block)
        return block

    def _write(self, kind: str, text: str, flush: bool = False) -> None:
        block = self._open
        if block is None or block["type"] != kind:
            if kind == TEXT and not text.strip() and not flush:
                self._held_text += text
                return
            empty: dict[str, Any] = {"type": kind, kind: ""}
            if kind == THINKING:
                empty["signature"] = ""  # nothing signs a local model's thinking
            block = self._start(empty)
            if kind == TEXT:
                text, self._held_text = self._held_text + text, ""
        block[kind] += text
        delta_type, key = _DELTA[kind]
        self._emit("content_block_delta", index=self._index, delta={"type": delta_type, key: text})

    def _write_call(self, call: ToolCallDelta) -> None:
        if call.name is not None or self._open is None or self._open_call != call.index:
            self._held_text = ""
            self._start({"type": TOOL_USE, "id": new_item_id("toolu"), "name": call.name or "",
                         "input": {}})  # fmt: skip
            self._open_call = call.index
        self._arguments.append(call.arguments)
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            self._emit("content_block_delta", index=self._index, delta=delta)

    def _close(self) -> None:
        block, self._open, self._open_call = self._open, None, None
        if block is None:
            return
        if block["type"] == TOOL_USE:
            block["input"] = tool_input("".join(self._arguments))
            self._arguments = []
        self._emit("content_block_stop", index=self._index)


def stop_reason(
    reason: FinishReason | None, matched: int | str | None, num_calls: int, stops: Sequence[str]
) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence."""
    if reason == FinishReason.LENGTH:
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _chat_request(body: MessagesRequest) -> MessagesChatRequest:
    try:
        return chat_request_for(body)
    except (InvalidRequestError, ValidationError) as exc:
        raise translated_request_error(exc) from None


async def _prepare(
    ctx: ServingContext, body: MessagesRequest
) -> tuple[MessagesChatRequest, PreparedChat, str | None]:
    ctx.check_model(body.model)
    chat_body = _chat_request(body)
    prepared, blob = await prepare_chat_request(ctx, chat_body)
    return chat_body, prepared, blob


async def count_tokens(ctx: ServingContext, body: MessagesRequest) -> dict[str, Any]:
    _, prepared, _ = await _prepare(ctx, body)
    return {"input_tokens": len(prepared.prompt_ids)}


def _usage(group: GenerationGroup) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""
    prompt, completion, cached = group.usage()
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }


async def create_message(ctx: ServingContext, body: MessagesRequest, request: Request) -> Response:
    ctx.check_capacity(1)  # early: no tokenizing for a request that would get a 503
    chat_body, prepared, blob = await _prepare(ctx, body)
    params = ctx.sampling_params_for(
        chat_body, prepared.prompt_ids, "messages", prepared.constraint
    )
    message_id = new_item_id("msg")
    group = GenerationGroup(ctx, message_id, [prepared.prompt_ids], [params], blob)
    header = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": body.model or ctx.served_model_name,
    }
    group.start(request)
    if body.stream:
        events = EventQueue(numbered=False)
        return stream_response(
            _stream(group, body, prepared, header, events), message_id, _error_events
        )
    early = await group.collect()
    if early is not None:
        return early
    choice = group.choices[0]
    parser = prepared.new_parser()
    blocks = ContentBlocks()
    for text, num_tokens in zip(choice.text_parts, choice.part_num_tokens, strict=True):
        blocks.feed(parser.feed(text, num_tokens))
    blocks.feed(parser.finish())
    blocks.finish()
    stops = body.stop_sequences or []
    reason, sequence = stop_reason(
        choice.finish_reason, choice.matched_stop, blocks.num_calls, stops
    )
    return JSONResponse(
        {
            **header,
            "content": blocks.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(group),
        }
    )


async def _stream(
    group: GenerationGroup,
    body: MessagesRequest,
    prepared: PreparedChat,
    header: dict[str, Any],
    events: EventQueue,
) -> AsyncIterator[str]:
    parser = prepared.new_parser()
    blocks = ContentBlocks(events)
    prompt_tokens = len(group.prompts[0])
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    start = {**header, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    events.emit("message_start", message=start)
    events.emit("ping")
    finish, matched = None, None
    try:
        for event in events.take():
            yield event
        async for _, output in group.stream_outputs():
            blocks.feed(parser.feed(output.text, output.num_new_tokens))
            if output.finish_reason is not None:
                blocks.feed(parser.finish())
                blocks.finish()
                finish, matched = output.finish_reason, output.matched_stop
            for event in events.take():
                yield event
        stops = body.stop_sequences or []
        reason, sequence = stop_reason(finish, matched, blocks.num_calls, stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.emit("message_delta", delta=delta, usage=_usage(group))
        events.emit("message_stop")
        for event in events.take():
            yield event
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished


def _error_events(body: dict[str, Any]) -> list[str]:
    """A stream that fails ends with Anthropic's error event."""
    events = EventQueue(numbered=False)
    error = body["error"]
    events.emit("error", error=anthropic_error(error.get("code"), error["message"])["error"])
    return events.take()
