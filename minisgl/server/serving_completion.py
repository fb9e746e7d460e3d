"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from minisgl.core import FinishReason, TokenLogprob
from minisgl.server.generation import (
    ChoiceState,
    ClientDisconnected,
    GenerationGroup,
    RequestError,
    ServingContext,
    build_sampling_params,
    finish_reason_text,
    resolve_max_tokens,
)
from minisgl.server.protocol import CompletionRequest, error_dict, new_id, now_s, usage_dict
from minisgl.server.serving_chat import CLIENT_CLOSED_REQUEST
from minisgl.server.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event


def tokenize_prompts(ctx: ServingContext, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Every accepted prompt shape -> (token ids per prompt, text per prompt for echo)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    ids_per_prompt: list[list[int]] = []
    texts: list[str] = []
    for item in prompt:
        if isinstance(item, str):
            ids = list(ctx.tokenizer(item)["input_ids"])
            text = item
        else:
            ids = [int(t) for t in item]
            if any(not 0 <= t < ctx.vocab_size for t in ids):
                raise RequestError(
                    400, f"prompt: token ids must be in [0, {ctx.vocab_size})", param="prompt"
                )
            text = cast(str, ctx.tokenizer.decode(ids))
        if not ids:
            raise RequestError(400, "prompt: must not be empty", param="prompt")
        ids_per_prompt.append(ids)
        texts.append(text)
    return ids_per_prompt, texts


def completion_logprobs(
    ctx: ServingContext, choice: ChoiceState, logprobs: Sequence[TokenLogprob]
) -> dict[str, Any]:
    """The legacy completions format; text_offset continues across stream chunks."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in logprobs:
        text = ctx.token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({ctx.token_text(tid): tlp for tid, tlp in lp.top})
        text_offset.append(choice.logprob_text_offset)
        choice.logprob_text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    ctx.check_model(body.model)
    prompts, prompt_texts = await ctx.off_loop(tokenize_prompts, ctx, body.prompt)
    params = []
    for ids in prompts:
        # Without max_tokens each prompt may use whatever context its own length leaves.
        max_tokens = resolve_max_tokens(
            body.max_tokens, len(ids), ctx.max_model_len, ctx.kv_capacity_tokens, "prompt"
        )
        params.append(
            [build_sampling_params(body, max_tokens, body.logprobs, j) for j in range(body.n)]
        )
    request_id = new_id("cmpl")
    group = GenerationGroup(ctx, request_id, prompts, params)
    header = {"id": request_id, "created": now_s(), "model": body.model or ctx.served_model_name}
    for choice in group.choices:
        echo_text = prompt_texts[choice.prompt_index] if body.echo else ""
        choice.logprob_text_offset = len(echo_text)
    group.start(request)
    if body.stream:
        return StreamingResponse(
            _stream(ctx, group, body, header, prompt_texts),
            media_type=SSE_MEDIA_TYPE,
            headers=SSE_HEADERS,
        )
    try:
        await group.run_to_end()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    error = group.first_error()
    if error is not None:
        raise RequestError(400, error)
    choices = []
    for choice in group.choices:
        echo_text = prompt_texts[choice.prompt_index] if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(ctx, choice, choice.logprobs)
        choices.append(
            {
                "index": choice.index,
                "text": echo_text + choice.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason_text(choice.finish_reason),
            }
        )
    body_json = {
        **header,
        "object": "text_completion",
        "choices": choices,
        "usage": usage_dict(*group.usage()),
    }
    return JSONResponse(body_json)


async def _stream(
    ctx: ServingContext,
    group: GenerationGroup,
    body: CompletionRequest,
    header: dict,
    prompt_texts: list[str],
) -> AsyncIterator[str]:
    base = {**header, "object": "text_completion"}
    if body.include_usage_in_stream:
        base["usage"] = None

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse_event({**base, "choices": [choice]})

    try:
        if body.echo:
            for choice in group.choices:
                yield chunk(choice.index, prompt_texts[choice.prompt_index])
        while not group.done:
            choice, output = await group.next_output()
            if output.finish_reason == FinishReason.ERROR:
                yield sse_event(error_dict(output.error or "request failed"))
                yield SSE_DONE
                return
            logprobs = None
            if body.logprobs is not None and output.logprobs:
                logprobs = completion_logprobs(ctx, choice, output.logprobs)
            finish = finish_reason_text(output.finish_reason)
            if output.text or finish is not None or logprobs is not None:
                yield chunk(choice.index, output.text, logprobs, finish)
        if body.include_usage_in_stream:
            yield sse_event({**base, "choices": [], "usage": usage_dict(*group.usage())})
        yield SSE_DONE
    except ClientDisconnected:
        return
    finally:
        group.close()
