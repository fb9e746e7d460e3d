"""POST /v1/chat/completions.

The request is prepared by minisgl.chat (template, tools, constraint) on the tokenizer thread;
each choice's reply goes through its own `ChatOutputParser`, so reasoning, content and tool
calls are split the same way streamed or not.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.chat import ChatDelta, ChatOutputParser, PreparedChat, prepare_chat
from minisgl.core import FinishReason, InvalidRequestError, TokenLogprob
from minisgl.server.generation import (
    ChoiceState,
    GenerationGroup,
    RequestError,
    ServingContext,
    finish_reason_text,
    invalid_request,
    stream_response,
)
from minisgl.server.protocol import ChatCompletionRequest, new_id, now_s, usage_dict
from minisgl.server.sampling_fields import stop_reason
from minisgl.server.sse import SSE_DONE, sse_event


def chat_logprobs(ctx: ServingContext, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(tid, tlp) for tid, tlp in lp.top]
        content.append(item)
    return {"content": content}


def _prepare(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[PreparedChat, str | None]:
    """On the tokenizer thread: render, tokenize, compile the constraint (its blob)."""
    prepared = prepare_chat(
        ctx.tokenizer,
        ctx.chat,
        body.messages,
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=body.template_kwargs,
        separate_reasoning=body.separate_reasoning,
        constraint_fields=body.constraint_fields,
    )
    blob = None
    if prepared.constraint is not None:
        blob = ctx.compile_constraint(prepared.constraint, prepared.constraint_param or "")
    return prepared, blob


async def prepare_chat_request(
    ctx: ServingContext, body: ChatCompletionRequest
) -> tuple[PreparedChat, str | None]:
    """The prompt, its constraint and parsers, and the compiled constraint; a 400 for any
    broken rule, named as this endpoint's clients spell the field."""
    try:
        return await ctx.off_loop(_prepare, ctx, body)
    except InvalidRequestError as exc:
        raise invalid_request(exc, body) from None
    except ValueError as exc:
        param = body.wire_param("messages")
        raise RequestError(
            400, f"{param}: {exc}" if param != "messages" else str(exc), param=param
        ) from None


class CallIds:
    """OpenAI tool call ids, one per (choice, call)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], str] = {}

    def get(self, choice: int, call: int) -> str:
        return self._ids.setdefault((choice, call), f"call_{uuid.uuid4().hex[:24]}")


def _finish_text(reason: FinishReason | None, parser: ChatOutputParser) -> str | None:
    if reason == FinishReason.STOP and parser.num_calls > 0:
        return "tool_calls"
    return finish_reason_text(reason)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    ctx.check_model(body.model)
    ctx.check_fan_out(1, body.n)
    ctx.check_capacity(body.n)  # early: no tokenizing for a request that would get a 503
    prepared, blob = await prepare_chat_request(ctx, body)
    prompt_ids = prepared.prompt_ids
    params = ctx.sampling_params_for(body, prompt_ids, "messages", prepared.constraint)
    request_id = new_id("chatcmpl")
    group = GenerationGroup(ctx, request_id, [prompt_ids], [params], blob)
    header = {
        "id": request_id,
        "created": now_s(),
        "model": body.model or ctx.served_model_name,
    }
    group.start(request)
    if body.stream:
        return stream_response(_stream(ctx, group, body, header, prepared), request_id)
    early = await group.collect()
    if early is not None:
        return early
    call_ids = CallIds()
    choices, reasoning_tokens = [], 0
    for choice in group.choices:
        parser = prepared.new_parser()
        message = _message(choice, parser, prepared, call_ids)
        reasoning_tokens += parser.reasoning_tokens
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": chat_logprobs(ctx, choice.logprobs) if body.logprobs else None,
                "finish_reason": _finish_text(choice.finish_reason, parser),
                "stop_reason": stop_reason(body, choice.matched_stop),
            }
        )
    return JSONResponse(
        {
            **header,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage_dict(*group.usage(), reasoning_tokens),
        }
    )


def _message(
    choice: ChoiceState, parser: ChatOutputParser, prepared: PreparedChat, call_ids: CallIds
) -> dict[str, Any]:
    """The whole reply, parsed by the same machine that parses streams."""
    deltas = [
        parser.feed(text, num_tokens)
        for text, num_tokens in zip(choice.text_parts, choice.part_num_tokens, strict=True)
    ]
    deltas.append(parser.finish())
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.name is not None:
                calls[call.index] = {
                    "id": call_ids.get(choice.index, call.index),
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            calls[call.index]["function"]["arguments"] += call.arguments
    # OpenAI: content is null when the reply is only tool calls (or only reasoning).
    empty_is_null = bool(calls) or prepared.reasoning_parser is not None
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if not content and empty_is_null else content,
    }
    if prepared.reasoning_parser is not None:
        message["reasoning_content"] = message["reasoning"] = reasoning or None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _delta_dict(delta: ChatDelta, choice: int, call_ids: CallIds) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        # One entry per call in a chunk (as OpenAI sends them): a call's name and the first
        # of its arguments can arrive in one step; clients reading tool_calls[0] see both.
        calls: dict[int, dict[str, Any]] = {}
        for call in delta.tool_calls:
            if call.name is not None:  # a call's first delta: who is called
                calls[call.index] = {
                    "index": call.index,
                    "id": call_ids.get(choice, call.index),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            elif call.index in calls:
                calls[call.index]["function"]["arguments"] += call.arguments
            else:
                calls[call.index] = {"index": call.index, "function": {"arguments": call.arguments}}
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


async def _stream(
    ctx: ServingContext,
    group: GenerationGroup,
    body: ChatCompletionRequest,
    header: dict,
    prepared: PreparedChat,
) -> AsyncIterator[str]:
    base = {**header, "object": "chat.completion.chunk"}
    if body.include_usage_in_stream:
        base["usage"] = None  # OpenAI sends usage null on every chunk but the last

    def chunk(
        index: int, delta: dict, logprobs: Any = None, finish: str | None = None, stop: Any = None
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return sse_event({**base, "choices": [choice]})

    # Each choice's role chunk goes out with its first output, not at once: benchmark clients
    # (vllm bench serve) time the first token at the first chunk, as OpenAI and vLLM send it.
    announced: set[int] = set()
    parsers = {choice.index: prepared.new_parser() for choice in group.choices}
    call_ids = CallIds()
    try:
        async for choice, output in group.stream_outputs():
            if choice.index not in announced:
                announced.add(choice.index)
                yield chunk(choice.index, {"role": "assistant", "content": ""})
            parser = parsers[choice.index]
            parsed = parser.feed(output.text, output.num_new_tokens)
            finish = None
            if output.finish_reason is not None:
                rest = parser.finish()
                parsed.reasoning += rest.reasoning
                parsed.content += rest.content
                parsed.tool_calls += rest.tool_calls
                finish = _finish_text(output.finish_reason, parser)
            delta = _delta_dict(parsed, choice.index, call_ids)
            logprobs = chat_logprobs(ctx, output.logprobs) if body.logprobs else None
            if delta or finish is not None or (logprobs and logprobs["content"]):
                stop = stop_reason(body, output.matched_stop)
                yield chunk(choice.index, delta, logprobs, finish, stop)
        if body.include_usage_in_stream:
            reasoning_tokens = sum(p.reasoning_tokens for p in parsers.values())
            usage = usage_dict(*group.usage(), reasoning_tokens)
            yield sse_event({**base, "choices": [], "usage": usage})
        yield SSE_DONE
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished
