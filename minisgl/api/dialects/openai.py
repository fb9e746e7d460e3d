"""OpenAI's chat completions (POST /v1/chat/completions), /v1/models, and what text
completions (minisgl.api.dialects.completions) share with them: the sampling fields, usage,
the chunks, and their fold (`accumulate`), which is the non-streaming reply."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator
from starlette.responses import Response

from minisgl.api.pipeline import Event, Run, ServingContext
from minisgl.api.request import (
    ApiRequest,
    ChatWire,
    JsonObject,
    SamplingWire,
    WireModel,
    new_id,
    sampling_of,
)
from minisgl.api.sse import respond
from minisgl.chat import ChatDelta, ChatPrompt, with_reasoning_effort
from minisgl.chat.requests import CONSTRAINT_FIELDS
from minisgl.core import FinishReason, TokenLogprob
from minisgl.limits import MAX_CHOICES_PER_REQUEST, InvalidRequestError
from minisgl.tokenizer.detokenizer import stop_reason

CHAT_ALIASES = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


class StreamOptions(WireModel):
    include_usage: bool = False


class OpenAISampling(SamplingWire):
    """The fields chat and text completions share. None means "the default"."""

    max_tokens: int | None = None
    stop: str | list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM: the stop string stays in the text
    n: int = Field(1, ge=1, le=MAX_CHOICES_PER_REQUEST)
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs (minisgl.chat.requests): at most one of these per request.
    response_format: JsonObject | None = None
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    json_schema: str | JsonObject | None = None  # SGLang: a JSON schema (text or object)
    guided_json: str | JsonObject | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: JsonObject | None = None  # vLLM: {json|regex|grammar|choice}

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
        return self

    @property
    def constraint_fields(self) -> JsonObject:
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}

    @property
    def stream_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(OpenAISampling, ChatWire):
    # Content checks (roles, text parts) happen in minisgl.chat.template with clear messages.
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # SGLang: false keeps the reasoning inside the content
    # OpenAI's: reaches the template as `reasoning_effort` (as in vLLM); "none" also turns a
    # hybrid model's thinking off (Qwen3's enable_thinking=false) unless the request sets it.
    reasoning_effort: str | None = None

    def to_api(self) -> ApiRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        sampling, wire_names = sampling_of(self, CHAT_ALIASES)
        sampling["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        prompt = ChatPrompt(
            self.messages,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            with_reasoning_effort(self.chat_template_kwargs, self.reasoning_effort),
            self.separate_reasoning,
        )
        return ApiRequest(prompt, sampling, wire_names, self.n, self.model, self.constraint_fields)


def usage_dict(run: Run, reasoning_tokens: int | None = None) -> JsonObject:
    """reasoning_tokens: part of completion_tokens (chat); None leaves the details out."""
    prompt_tokens, completion_tokens, cached_tokens = run.usage()
    usage: JsonObject = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def chat_logprobs(ctx: ServingContext, logprobs: Sequence[TokenLogprob]) -> list[JsonObject]:
    """Chat's `logprobs.content` (the Responses API's `logprobs`) of these tokens."""

    def entry(token_id: int, logprob: float) -> JsonObject:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    # lp.top: (token id, logprob) pairs
    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*top) for top in lp.top]}
        for lp in logprobs
    ]


def _delta_dict(delta: ChatDelta) -> JsonObject:
    out: JsonObject = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    # One entry per call in a chunk (as OpenAI sends them): a call's name and the first of its
    # arguments can arrive in one step; clients reading tool_calls[0] see both.
    calls: dict[int, JsonObject] = {}
    for call in delta.tool_calls:
        entry = calls.setdefault(call.index, {"index": call.index, "function": {"arguments": ""}})
        if call.name is not None:  # a call's first delta (once per call): who is called
            entry |= {"id": new_id("call", "_"), "type": "function"}
            entry["function"]["name"] = call.name
        entry["function"]["arguments"] += call.arguments
    if calls:
        out["tool_calls"] = list(calls.values())
    return out


def header(run: Run, body: OpenAISampling, kind: str) -> JsonObject:
    head = {
        "id": run.id,
        "object": kind,
        "created": int(time.time()),
        "model": run.model_name,
    }
    if body.stream_usage:
        head["usage"] = None  # OpenAI sends usage null on every chunk but the last
    return head


def chunk(base: JsonObject, index: int, finish: str | None = None, **part: Any) -> dict:
    """A chunk of one choice; a finished one also says what stopped it (vLLM's stop_reason)."""
    return {**base, "choices": [{"index": index, **part, "finish_reason": finish}]}


def choice_chunk(run: Run, base: JsonObject, event: Event, **part: Any) -> JsonObject:
    """The chunk of one output, finish_reason and stop_reason set at its end."""
    finish = None
    if (reason := event.output.finish_reason) is not None:
        called = event.choice.parser is not None and event.choice.parser.num_calls
        finish = "tool_calls" if reason == FinishReason.STOP and called else reason.value
        part["stop_reason"] = stop_reason(run.params[0], event.output.matched_stop)
    return chunk(base, event.choice.index, finish, **part)


async def chat_events(run: Run, body: ChatCompletionRequest) -> AsyncIterator[JsonObject]:
    base = header(run, body, "chat.completion.chunk")
    # Each choice's role chunk goes out with its first output, not at once: benchmark clients
    # (vllm bench serve) time the first token at the first chunk, as OpenAI and vLLM send it.
    announced: set[int] = set()
    async for event in run.events():
        choice, output = event.choice, event.output
        if choice.index not in announced:
            announced.add(choice.index)
            yield chunk(
                base, choice.index, delta={"role": "assistant", "content": ""}, logprobs=None
            )
        delta = _delta_dict(event.delta)
        scored = chat_logprobs(run.ctx, output.logprobs)  # empty unless the request asked
        logprobs = {"content": scored} if body.logprobs else None
        if delta or output.finish_reason is not None or scored:
            yield choice_chunk(run, base, event, delta=delta, logprobs=logprobs)
    if body.stream_usage or not body.stream:
        yield {**base, "choices": [], "usage": usage_dict(run, run.reasoning_tokens)}


def accumulate(total: JsonObject, delta: JsonObject) -> JsonObject:
    """OpenAI's rule for adding up a stream's deltas (its SDK's `accumulate_delta`): text is
    appended, objects merge key by key, a list's entries with an integer "index" merge into the
    entry of that index and other entries are appended; null adds nothing and any other value
    replaces the last. `delta` is taken over, not copied."""
    for key, value in delta.items():
        old = total.get(key)
        if value is None:
            total.setdefault(key, None)
        elif isinstance(old, str) and isinstance(value, str):
            total[key] = old + value
        elif isinstance(old, dict) and isinstance(value, dict):
            accumulate(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            for entry in value:
                index = entry.get("index") if isinstance(entry, dict) else None
                same = [e for e in old if type(index) is int and e["index"] == index]
                if same:
                    accumulate(same[0], entry)
                else:
                    old.append(entry)
        else:
            total[key] = value
    return total


def fold(chunks: list[JsonObject], kind: str) -> JsonObject:
    """A stream's chunks added up: the reply, its choices in index order."""
    choices: dict[int, JsonObject] = {}
    for sent in chunks:
        for part in sent["choices"]:
            accumulate(choices.setdefault(part["index"], {"stop_reason": None}), part)
    return {
        **{key: chunks[0][key] for key in ("id", "created", "model")},
        "object": kind,
        "usage": chunks[-1]["usage"],
        "choices": [choices[i] for i in sorted(choices)],
    }


def fold_chat(chunks: list[JsonObject], with_reasoning: bool) -> JsonObject:
    """The chunks of a chat stream as one chat.completion (OpenAI's non-streaming reply)."""
    reply = fold(chunks, "chat.completion")
    for choice in reply["choices"]:
        message = choice.pop("delta")
        for call in message.get("tool_calls", ()):
            del call["index"]
        # OpenAI: content is null when the reply is only tool calls (or only reasoning).
        if not message.get("content") and (message.get("tool_calls") or with_reasoning):
            message["content"] = None
        if with_reasoning:
            reasoning = message.pop("reasoning_content", None) or None
            message["reasoning_content"] = message["reasoning"] = reasoning
        choice["message"] = message
    return reply


router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    run = await Run(request, body.to_api(), new_id("chatcmpl")).start()
    assert run.chat is not None
    return await respond(
        run,
        chat_events(run, body),
        body.stream,
        functools.partial(fold_chat, with_reasoning=run.chat.reasoning_parser is not None),
    )


def _model_card(ctx: ServingContext) -> JsonObject:
    return {
        "id": ctx.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "minisgl",
        # The longest sequence that can run: the KV pool may hold less than the context.
        "max_model_len": ctx.limits.max_seq_len,
        # /v1/embeddings: every model embeds (docs/server.md)
        "pooling": {"mode": ctx.pooling.mode, "normalize": ctx.pooling.normalize},
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JsonObject:
    return {"object": "list", "data": [_model_card(request.app.state.ctx)]}


@router.get("/v1/models/{model_id:path}")  # ids may hold a slash (Qwen/Qwen3-8B)
async def retrieve_model(model_id: str, request: Request) -> JsonObject:
    request.app.state.ctx.check_model(model_id)
    return _model_card(request.app.state.ctx)
