"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items. A request runs as a chat; its output items stream as OpenAI's
numbered events, the last of which carries the whole response (the non-streaming reply).
Stored responses live in this process's memory, bounded by count and size, for GET and a
later `previous_response_id`. docs/server.md#openais-responses-api is the reference."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from minisgl.api.dialects.openai import chat_logprobs
from minisgl.api.dialects.responses_items import (
    FUNCTION_KEYS,
    OutputItems,
    input_items,
    input_messages,
    response_format,
)
from minisgl.api.errors import RequestError
from minisgl.api.pipeline import Run
from minisgl.api.request import (
    ApiRequest,
    ChatWire,
    JsonObject,
    chat_tool_choice,
    chat_tools,
    new_id,
    sampling_of,
)
from minisgl.api.sse import respond
from minisgl.chat import ChatPrompt, ReplyBlocks, with_reasoning_effort
from minisgl.core import FinishReason
from minisgl.limits import (
    MAX_LISTED_ITEMS,
    MAX_STORED_CHARS,
    MAX_STORED_RESPONSES,
    InvalidRequestError,
)

ALIASES = {
    "max_output_tokens": "max_tokens",
    "top_logprobs": "logprobs",
    "input": "messages",
    "text.format": "response_format",
}
# The response's fields that are the request's, as it sent them.
EXPECTED_TOOL_CHOICE = "'none', 'auto', 'required' or {'type': 'function', 'name'}"
ECHOED_FIELDS = (
    *("instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id"),
    *("metadata", "store", "top_logprobs", "user"),
)


class ResponsesRequest(ChatWire):
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int = 0
    include: list[str] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool = True
    text: JsonObject | None = None
    reasoning: JsonObject | None = None
    store: bool = True
    metadata: dict[str, str] = {}  # pydantic copies it for each request
    user: str | None = None
    truncation: str | None = None
    background: bool = False
    stop: str | list[str] | None = None  # an extra, as vLLM's

    @property
    def effort(self) -> str | None:
        return (self.reasoning or {}).get("effort")

    def to_api(self, store: ResponseStore) -> tuple[ApiRequest, list[JsonObject]]:
        """The request to run, and the conversation without instructions (what a later
        `previous_response_id` continues; the earlier turns come from `store`)."""
        if self.background:
            raise InvalidRequestError(
                "background", "is not supported: a response runs while its request is open"
            )
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError(
                "truncation", "only 'disabled' is supported (a prompt that is too long is a 400)"
            )
        turns = input_messages(self.input)
        if self.previous_response_id is not None:
            previous = store.get(self.previous_response_id, "previous_response_id")
            turns = [*previous.conversation, *turns]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        sampling, wire_names = sampling_of(self, ALIASES)
        wants_logprobs = "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs
        sampling["logprobs"] = self.top_logprobs if wants_logprobs else None
        prompt = ChatPrompt(
            system + turns,
            chat_tools(self.tools, "function", FUNCTION_KEYS),
            chat_tool_choice(self.tool_choice, "function", {}, EXPECTED_TOOL_CHOICE),
            self.parallel_tool_calls,
            with_reasoning_effort(self.chat_template_kwargs, self.effort),
        )
        constraint_fields = {"response_format": response_format(self.text)}
        return ApiRequest(prompt, sampling, wire_names, 1, self.model, constraint_fields), turns


@dataclass(frozen=True)
class StoredResponse:
    response: JsonObject  # the response object, as the client received it
    conversation: list[JsonObject]  # chat messages, this response's reply included
    input_items: list[JsonObject]  # this request's input, as GET .../input_items lists it
    size_chars: int


@dataclass
class ResponseStore:
    """Stored responses, oldest out first. Each entry keeps its whole conversation, so a long
    chain costs its length once per turn; the size bound keeps that in check. Private to one
    server: behind a gateway a follow-up must reach the same replica."""

    max_entries: int = MAX_STORED_RESPONSES
    max_chars: int = MAX_STORED_CHARS
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict, init=False)

    def put(self, response: JsonObject, conversation: list[Any], items: list[Any]) -> None:
        size = sum(len(json.dumps(part)) for part in (response, conversation, items))
        if size > self.max_chars:
            return  # larger than the whole store: keeping it would evict everything else
        self._entries[response["id"]] = StoredResponse(response, conversation, items, size)
        while len(self._entries) > self.max_entries or (
            sum(entry.size_chars for entry in self._entries.values()) > self.max_chars
        ):
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response; a 404 naming `param` when there is none."""
        if (entry := self._entries.get(response_id)) is None:
            kept = "responses are kept in this server's memory while it runs, when store is true"
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"{param}: no stored response {response_id!r} ({kept})",
                param=param,
            )
        self._entries.move_to_end(response_id)  # a chain in use stays
        return entry

    def delete(self, response_id: str) -> None:
        """A 404 when there is none."""
        self.get(response_id)
        del self._entries[response_id]


class Turn(OutputItems):
    """One request's response: its fixed fields, then its output items, usage and events as
    they come. Every event is a snapshot: what it shows (an item, a part) keeps changing after."""

    def __init__(self, body: ResponsesRequest, run: Run, conversation: list[Any]) -> None:
        super().__init__()
        self._body = body
        self._run = run
        self._conversation = conversation
        params = run.params[0]  # with the model's sampling defaults applied
        self._fields: JsonObject = {
            "id": run.id,
            "object": "response",
            "created_at": int(time.time()),
            "background": False,
            "model": run.model_name,
            "reasoning": {"effort": body.effort, "summary": None},
            "temperature": params.temperature,
            # text.format: checked by to_api (an object, or absent)
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": params.top_p,
            "truncation": "disabled",
            **{name: getattr(body, name) for name in ECHOED_FIELDS},
        }

    def response(self, status: str, error: JsonObject | None = None) -> JsonObject:
        usage = None
        if status not in ("in_progress", "failed"):
            prompt, completion, cached = self._run.usage()
            usage = {
                "input_tokens": prompt,
                # The radix cache keeps every prompt token it lacked.
                "input_tokens_details": {
                    "cached_tokens": cached,
                    "cache_write_tokens": prompt - cached,
                },
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": self._run.reasoning_tokens},
                "total_tokens": prompt + completion,
            }
        return {
            **self._fields,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": self.items,
            "usage": usage,
        }

    async def wire_events(self, store: ResponseStore) -> AsyncIterator[JsonObject]:
        self.emit("response.created", response=self.response("in_progress"))
        self.emit("response.in_progress", response=self.response("in_progress"))
        for wire_event in self.take():
            yield wire_event
        blocks = ReplyBlocks(self)
        async for event in self._run.events():  # logprobs: none unless the request asked
            blocks.feed(event.delta, chat_logprobs(self._run.ctx, event.output.logprobs))
            for wire_event in self.take():
                yield wire_event
        cut = self._run.choices[0].finish_reason == FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        blocks.finish(status)
        response = self.response(status)
        if self._body.store:
            store.put(
                response,
                [*self._conversation, self.assistant_message()],
                input_items(self._body.input),
            )
        self.emit(f"response.{status}", response=response)
        for wire_event in self.take():
            yield wire_event

    def error_events(self, body: JsonObject) -> list[JsonObject]:
        """A stream that fails: the error event, then response.failed (no [DONE] here)."""
        error = body["error"]
        self.emit("error", code=error["type"], message=error["message"], param=error.get("param"))
        status = error.get("code")
        client_error = isinstance(status, int) and status < HTTPStatus.INTERNAL_SERVER_ERROR
        code = "invalid_prompt" if client_error else "server_error"
        self.emit(
            "response.failed",
            response=self.response("failed", {"code": code, "message": error["message"]}),
        )
        return self.take()


router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    store: ResponseStore = request.app.state.responses
    api, conversation = body.to_api(store)
    run = await Run(request, api, new_id("resp", "_")).start()
    turn = Turn(body, run, conversation)
    events = turn.wire_events(store)
    # Not streaming: the stream's last event, which holds the whole response, is the reply.
    return await respond(
        run, events, body.stream, lambda sent: sent[-1]["response"], turn.error_events
    )


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JsonObject:
    return request.app.state.responses.get(response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JsonObject:
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def list_input_items(
    store: ResponseStore, response_id: str, limit: int, order: str, after: str | None
) -> JsonObject:
    """The request's input items, newest first unless order is "asc", `limit` at a time, from
    after the item `after`."""
    items = store.get(response_id).input_items
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"after: no input item {after!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.get("/v1/responses/{response_id}/input_items")
async def get_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_LISTED_ITEMS),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JsonObject:
    return list_input_items(request.app.state.responses, response_id, limit, order, after)
