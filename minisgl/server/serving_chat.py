"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.core import FinishReason, TokenLogprob
from minisgl.server.generation import (
    ClientDisconnected,
    GenerationGroup,
    RequestError,
    ServingContext,
    finish_reason_text,
    stream_response,
)
from minisgl.server.protocol import ChatCompletionRequest, error_dict, new_id, now_s, usage_dict
from minisgl.server.sse import SSE_DONE, sse_event
from minisgl.tokenizer import apply_chat_template

# HTTP status for a response nobody will read (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499


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


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    ctx.check_model(body.model)
    ctx.check_fan_out(1, body.n)
    ctx.check_capacity(body.n)  # early: no tokenizing for a request that would get a 503
    try:
        prompt_ids = await ctx.off_loop(apply_chat_template, ctx.tokenizer, body.messages)
    except ValueError as exc:
        raise RequestError(400, str(exc), param="messages") from None
    params = ctx.sampling_params_for(body, prompt_ids, "messages")
    request_id = new_id("chatcmpl")
    group = GenerationGroup(ctx, request_id, [prompt_ids], [params])
    header = {
        "id": request_id,
        "created": now_s(),
        "model": body.model or ctx.served_model_name,
    }
    group.start(request)
    if body.stream:
        return stream_response(_stream(ctx, group, body, header), request_id)
    try:
        await group.run_to_end()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    error = group.first_error()
    if error is not None:
        raise RequestError(400, error)
    choices = [
        {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": chat_logprobs(ctx, choice.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason_text(choice.finish_reason),
        }
        for choice in group.choices
    ]
    return JSONResponse(
        {
            **header,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage_dict(*group.usage()),
        }
    )


async def _stream(
    ctx: ServingContext, group: GenerationGroup, body: ChatCompletionRequest, header: dict
) -> AsyncIterator[str]:
    base = {**header, "object": "chat.completion.chunk"}
    if body.include_usage_in_stream:
        base["usage"] = None  # OpenAI sends usage null on every chunk but the last

    def chunk(index: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse_event({**base, "choices": [choice]})

    # Each choice's role chunk goes out with its first output, not at once: benchmark clients
    # (vllm bench serve) time the first token at the first chunk, as OpenAI and vLLM send it.
    announced: set[int] = set()
    try:
        while not group.done:
            choice, output = await group.next_output()
            if output.finish_reason == FinishReason.ERROR:
                yield sse_event(error_dict(output.error or "request failed"))
                yield SSE_DONE
                return
            if choice.index not in announced:
                announced.add(choice.index)
                yield chunk(choice.index, {"role": "assistant", "content": ""})
            delta = {"content": output.text} if output.text else {}
            logprobs = chat_logprobs(ctx, output.logprobs) if body.logprobs else None
            finish = finish_reason_text(output.finish_reason)
            if delta or finish is not None or (logprobs and logprobs["content"]):
                yield chunk(choice.index, delta, logprobs, finish)
        if body.include_usage_in_stream:
            yield sse_event({**base, "choices": [], "usage": usage_dict(*group.usage())})
        yield SSE_DONE
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished
