"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

A request is translated to a chat request (minisgl.server.responses_protocol) and runs as one.
Its reply's ChatDeltas (reasoning, content, tool calls) become output items in the order the
model wrote them: a `reasoning` item, a `message` with one `output_text` part, `function_call`
items. `OutputItems` (minisgl.server.response_items) builds them for the streamed and the
whole response alike, so the two agree. A stream sends OpenAI's event sequence
(response.created, response.in_progress, each item's added / delta / done events, then
response.completed or response.incomplete), every event numbered. With `store` (OpenAI's
default) the response is kept (minisgl.server.response_store) for GET and for a later
request's `previous_response_id`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.chat import ChatOutputParser, PreparedChat
from minisgl.core import FinishReason, InvalidRequestError, SamplingParams, TokenLogprob
from minisgl.server.errors import HTTP_BAD_REQUEST, HTTP_SERVER_ERROR, RequestError
from minisgl.server.generation import (
    ChoiceState,
    GenerationGroup,
    ServingContext,
    stream_response,
    translated_request_error,
)
from minisgl.server.protocol import new_item_id
from minisgl.server.response_items import OutputItems
from minisgl.server.responses_protocol import (
    ResponsesChatRequest,
    ResponsesRequest,
    chat_request_for,
    input_items,
)
from minisgl.server.serving_chat import chat_logprobs, prepare_chat_request
from minisgl.server.sse import EventQueue

HTTP_NOT_FOUND = 404


class _Turn:
    """One request's response: its fixed fields, then its output and usage as they come."""

    def __init__(
        self,
        ctx: ServingContext,
        body: ResponsesRequest,
        params: SamplingParams,
        prepared: PreparedChat,
        conversation: list[dict[str, Any]],
    ) -> None:
        self._ctx = ctx
        self._body = body
        self._conversation = conversation
        self._parser: ChatOutputParser = prepared.new_parser()
        self.events = EventQueue(numbered=True)
        self.output = OutputItems(self.events if body.stream else None)
        self.id = new_item_id("resp")
        self.finish_reason: FinishReason | None = None
        self._fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "background": False,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": body.model or ctx.served_model_name,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store,
            "temperature": params.temperature,
            "text": {"format": body.text_format},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": params.top_p,
            "truncation": "disabled",
            "user": body.user,
        }

    def feed(self, text: str, num_tokens: int, logprobs: Sequence[TokenLogprob]) -> None:
        entries = chat_logprobs(self._ctx, logprobs)["content"] if self._body.wants_logprobs else []
        self.output.feed(self._parser.feed(text, num_tokens), entries)

    def finish(self, reason: FinishReason | None) -> None:
        self.finish_reason = reason
        self.output.feed(self._parser.finish(), [])
        self.output.finish("incomplete" if reason == FinishReason.LENGTH else "completed")

    def response(
        self, group: GenerationGroup | None, status: str, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        usage = None
        if group is not None:
            prompt, completion, cached = group.usage()
            usage = {
                "input_tokens": prompt,
                # The radix cache keeps every prompt token it did not already hold.
                "input_tokens_details": {
                    "cached_tokens": cached,
                    "cache_write_tokens": prompt - cached,
                },
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": self._parser.reasoning_tokens},
                "total_tokens": prompt + completion,
            }
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            **self._fields,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": self.output.items,
            "usage": usage,
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == FinishReason.LENGTH else "completed"

    def keep(self, response: dict[str, Any]) -> None:
        if self._body.store:
            conversation = [*self._conversation, self.output.assistant_message()]
            self._ctx.responses.put(response, conversation, input_items(self._body.input))

    def error_events(self, body: dict[str, Any]) -> list[str]:
        """A stream that fails: the error event, then response.failed (no [DONE] here)."""
        error = body["error"]
        self.events.emit(
            "error", code=error["type"], message=error["message"], param=error.get("param")
        )
        client_error = isinstance(error.get("code"), int) and error["code"] < HTTP_SERVER_ERROR
        failure = {
            "code": "invalid_prompt" if client_error else "server_error",
            "message": error["message"],
        }
        self.events.emit("response.failed", response=self.response(None, "failed", failure))
        return self.events.take()


def _chat_request(
    ctx: ServingContext, body: ResponsesRequest
) -> tuple[ResponsesChatRequest, list[dict[str, Any]]]:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise RequestError(
                HTTP_NOT_FOUND,
                f"previous_response_id: no stored response {body.previous_response_id!r} "
                "(responses are kept in this server's memory while it runs, when store is true)",
                param="previous_response_id",
            )
        history = stored.conversation
    try:
        return chat_request_for(body, history)
    except (InvalidRequestError, ValidationError) as exc:
        raise translated_request_error(exc) from None


async def create_response(
    ctx: ServingContext, body: ResponsesRequest, request: Request
) -> Response:
    ctx.check_model(body.model)
    ctx.check_capacity(1)  # early: no tokenizing for a request that would get a 503
    chat_body, conversation = _chat_request(ctx, body)
    prepared, blob = await prepare_chat_request(ctx, chat_body)
    prompt_ids = prepared.prompt_ids
    params = ctx.sampling_params_for(chat_body, prompt_ids, "input", prepared.constraint)
    turn = _Turn(ctx, body, params[0], prepared, conversation)
    group = GenerationGroup(ctx, turn.id, [prompt_ids], [params], blob)
    group.start(request)
    if body.stream:
        return stream_response(_stream(turn, group), turn.id, turn.error_events)
    early = await group.collect()
    if early is not None:
        return early
    choice = group.choices[0]
    for text, num_tokens, logprobs in _parts(choice):
        turn.feed(text, num_tokens, logprobs)
    turn.finish(choice.finish_reason)
    response = turn.response(group, turn.status)
    turn.keep(response)
    return JSONResponse(response)


def _parts(choice: ChoiceState) -> list[tuple[str, int, Sequence[TokenLogprob]]]:
    """A finished choice's outputs as they arrived: text, tokens, those tokens' logprobs."""
    parts: list[tuple[str, int, Sequence[TokenLogprob]]] = []
    start = 0
    for text, num_tokens in zip(choice.text_parts, choice.part_num_tokens, strict=True):
        parts.append((text, num_tokens, choice.logprobs[start : start + num_tokens]))
        start += num_tokens
    return parts


async def _stream(turn: _Turn, group: GenerationGroup) -> AsyncIterator[str]:
    turn.events.emit("response.created", response=turn.response(None, "in_progress"))
    turn.events.emit("response.in_progress", response=turn.response(None, "in_progress"))
    try:
        for event in turn.events.take():
            yield event
        async for _, output in group.stream_outputs():
            turn.feed(output.text, output.num_new_tokens, output.logprobs)
            if output.finish_reason is not None:
                turn.finish(output.finish_reason)
            for event in turn.events.take():
                yield event
        response = turn.response(group, turn.status)
        turn.keep(response)
        kind = "response.incomplete" if turn.status == "incomplete" else "response.completed"
        turn.events.emit(kind, response=response)
        for event in turn.events.take():
            yield event
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished


def _not_found(response_id: str) -> RequestError:
    return RequestError(HTTP_NOT_FOUND, f"no stored response {response_id!r}", param="response_id")


def retrieve_response(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


def delete_response(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    if not ctx.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


MAX_LISTED_ITEMS = 100


def list_input_items(
    ctx: ServingContext, response_id: str, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: the request's input items, newest first unless
    order is "asc", `limit` at a time, from after the item `after`."""
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if not 1 <= limit <= MAX_LISTED_ITEMS:
        raise RequestError(HTTP_BAD_REQUEST, f"limit: must be in [1, {MAX_LISTED_ITEMS}]", "limit")
    if order not in ("asc", "desc"):
        raise RequestError(HTTP_BAD_REQUEST, "order: must be 'asc' or 'desc'", "order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise RequestError(HTTP_BAD_REQUEST, f"after: no input item {after!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
