"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.chat import constraint_from_fields
from minisgl.core import InvalidRequestError, TokenLogprob
from minisgl.server.generation import (
    ChoiceState,
    GenerationGroup,
    RequestError,
    ServingContext,
    finish_reason_text,
    invalid_request,
    stream_response,
)
from minisgl.server.protocol import CompletionRequest, new_id, now_s, usage_dict
from minisgl.server.sampling_fields import stop_reason
from minisgl.server.sse import SSE_DONE, sse_event


def prompt_list(prompt: Any) -> list[str] | list[list[int]]:
    """Every accepted prompt shape -> a list of prompts (each text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return cast("list[str] | list[list[int]]", prompt)


def tokenize_prompts(
    ctx: ServingContext, prompts: list[str] | list[list[int]]
) -> tuple[list[list[int]], list[str | None]]:
    """(token ids per prompt, text per prompt; None where the prompt was token ids)."""
    ids_per_prompt: list[list[int]] = []
    texts: list[str | None] = []
    for item in prompts:
        if isinstance(item, str):
            ids_per_prompt.append(list(ctx.tokenizer(item)["input_ids"]))
            texts.append(item)
        else:
            ids_per_prompt.append(list(item))
            texts.append(None)
    return ids_per_prompt, texts


def echo_texts(ctx: ServingContext, prompts: list[list[int]], texts: list[str | None]) -> list[str]:
    """Prompt texts for echo. Token id prompts are decoded only once every rule (the
    vocabulary range included) has passed."""
    return [
        text if text is not None else cast(str, ctx.tokenizer.decode(ids))
        for ids, text in zip(prompts, texts, strict=True)
    ]


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


def echo_logprobs(
    ctx: ServingContext, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob]
) -> dict[str, Any]:
    """The prompt's part of echo + logprobs, in the legacy format: every prompt token, the
    first with a null logprob and top_logprobs (nothing comes before it), offsets from 0."""
    tokens = [ctx.token_text(tid) for tid in prompt_ids]
    missing = [None] * (len(tokens) - 1 - len(scored))  # none arrived: the request was aborted
    offsets = [0]
    for text in tokens[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(lp.logprob for lp in scored), *missing],
        "top_logprobs": [
            None,
            *({ctx.token_text(tid): tlp for tid, tlp in lp.top} for lp in scored),
            *missing,
        ],
        "text_offset": offsets,
    }


def _first_output_offset(
    ctx: ServingContext, body: CompletionRequest, prompt_ids: Sequence[int], echo_text: str
) -> int:
    """text_offset of the first generated token under echo. With logprobs the prompt's tokens
    come first, their offsets summed over their texts as vLLM does; so the output continues
    from that sum, which differs from len(echo_text) where one character spans several tokens
    (each shows alone as U+FFFD): offsets never go back."""
    if body.logprobs is None:
        return len(echo_text)
    return sum(len(ctx.token_text(tid)) for tid in prompt_ids)


def _joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    ctx.check_model(body.model)
    prompts_in = prompt_list(body.prompt)
    ctx.check_fan_out(len(prompts_in), body.n)
    ctx.check_capacity(len(prompts_in) * body.n)  # early: no tokenizing for a 503
    try:
        found = constraint_from_fields(body.constraint_fields)
        constraint = found[1] if found else None
        blob = await ctx.off_loop(ctx.compile_constraint, found[1], found[0]) if found else None
    except InvalidRequestError as exc:
        raise invalid_request(exc, body) from None
    prompts, texts = await ctx.off_loop(tokenize_prompts, ctx, prompts_in)
    params = [ctx.sampling_params_for(body, ids, "prompt", constraint) for ids in prompts]
    prompt_texts = await ctx.off_loop(echo_texts, ctx, prompts, texts) if body.echo else []
    request_id = new_id("cmpl")
    group = GenerationGroup(ctx, request_id, prompts, params, blob)
    header = {"id": request_id, "created": now_s(), "model": body.model or ctx.served_model_name}
    for choice in group.choices:
        if body.echo:
            p = choice.prompt_index
            choice.logprob_text_offset = _first_output_offset(
                ctx, body, prompts[p], prompt_texts[p]
            )
    group.start(request)
    if body.stream:
        stream = _stream(ctx, group, body, header, prompts, prompt_texts)
        return stream_response(stream, request_id)
    early = await group.collect()
    if early is not None:
        return early
    choices = []
    for choice in group.choices:
        echo_text = prompt_texts[choice.prompt_index] if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(ctx, choice, choice.logprobs)
            if body.echo:
                prompt_ids = prompts[choice.prompt_index]
                echoed = echo_logprobs(ctx, prompt_ids, choice.prompt_logprobs)
                logprobs = _joined(echoed, logprobs)
        choices.append(
            {
                "index": choice.index,
                "text": echo_text + choice.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason_text(choice.finish_reason),
                "stop_reason": stop_reason(body, choice.matched_stop),
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
    prompts: list[list[int]],
    prompt_texts: list[str],
) -> AsyncIterator[str]:
    base = {**header, "object": "text_completion"}
    if body.include_usage_in_stream:
        base["usage"] = None

    def chunk(
        index: int, text: str, logprobs: Any = None, finish: str | None = None, stop: Any = None
    ) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return sse_event({**base, "choices": [choice]})

    # echo: the prompt goes first; with logprobs it waits for the choice's first output,
    # which brings the prompt's logprobs.
    echo_waits = body.echo and body.logprobs is not None
    try:
        if body.echo and not echo_waits:
            for choice in group.choices:
                yield chunk(choice.index, prompt_texts[choice.prompt_index])
        echoed: set[int] = set()
        async for choice, output in group.stream_outputs():
            if echo_waits and choice.index not in echoed:
                echoed.add(choice.index)
                prompt_ids = prompts[choice.prompt_index]
                scored = echo_logprobs(ctx, prompt_ids, output.prompt_logprobs)
                yield chunk(choice.index, prompt_texts[choice.prompt_index], scored)
            logprobs = None
            if body.logprobs is not None and output.logprobs:
                logprobs = completion_logprobs(ctx, choice, output.logprobs)
            finish = finish_reason_text(output.finish_reason)
            if output.text or finish is not None or logprobs is not None:
                stop = stop_reason(body, output.matched_stop)
                yield chunk(choice.index, output.text, logprobs, finish, stop)
        if body.include_usage_in_stream:
            yield sse_event({**base, "choices": [], "usage": usage_dict(*group.usage())})
        yield SSE_DONE
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished
