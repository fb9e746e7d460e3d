"""OpenAI's text completions: POST /v1/completions (echo, the legacy logprobs format).

A non-streaming reply is the fold of the chunks a stream sends (minisgl.api.dialects.openai).
"""

import functools
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from fastapi import APIRouter, Request
from starlette.responses import Response

from minisgl.api.dialects.openai import (
    OpenAISampling,
    choice_chunk,
    chunk,
    fold,
    header,
    usage_dict,
)
from minisgl.api.pipeline import Run, ServingContext
from minisgl.api.request import ApiRequest, FailFastList, JsonObject, new_id, sampling_of
from minisgl.api.sse import respond
from minisgl.core import TokenLogprob
from minisgl.limits import DEFAULT_MAX_TOKENS, InvalidRequestError

LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class CompletionRequest(OpenAISampling):
    prompt: str | FailFastList[str] | FailFastList[int] | FailFastList[FailFastList[int]]
    logprobs: int | None = None
    echo: bool = False
    # Not supported; refused rather than ignored, so a client learns its request was not run
    # as written (vLLM refuses suffix too). best_of equal to n is plain sampling.
    suffix: str | None = None
    best_of: int | None = None

    def to_api(self) -> ApiRequest:
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", "is not supported (other than equal to n)")
        prompt = self.prompt
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        single = isinstance(prompt, str) or isinstance(prompt[0], int)
        prompts = cast("list[str] | list[list[int]]", [prompt] if single else prompt)
        sampling, wire_names = sampling_of(self, {})
        sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        # echo with logprobs scores the prompt too (OpenAI: the first token's is null); echo
        # with max_tokens 0 only echoes, through the same prompt-only path.
        scored = self.echo and (self.logprobs is not None or sampling["max_tokens"] == 0)
        sampling["prompt_logprobs"] = (self.logprobs or 0) if scored else None
        return ApiRequest(prompts, sampling, wire_names, self.n, self.model, self.constraint_fields)


def _legacy_logprobs(
    ctx: ServingContext,
    token_ids: Sequence[int],
    scored: Sequence[TokenLogprob | None],
    offset: int,
) -> tuple[JsonObject, int]:
    """The legacy completions format of `token_ids`, text offsets counted from `offset`, and the
    offset after them; a token `scored` leaves None or short of (a prompt's first, the rest of an
    aborted one) gets nulls."""
    tokens = [ctx.token_text(tid) for tid in token_ids]
    scored = [*scored, *[None] * (len(tokens) - len(scored))]
    *starts, end = itertools.accumulate(map(len, tokens), initial=offset)
    table = {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
        "top_logprobs": [
            None if lp is None else {ctx.token_text(tid): tlp for tid, tlp in lp.top}
            for lp in scored
        ],
        "text_offset": starts,
    }
    return table, end


def _echo_texts(run: Run) -> list[str]:
    """Prompt texts for echo, on the tokenizer thread: token id prompts are decoded only now,
    once every rule (the vocabulary range included) has passed."""
    given = zip(cast("list[Any]", run.req.prompt), run.prompts, strict=True)
    return [
        text if isinstance(text, str) else str(run.ctx.tokenizer.decode(ids)) for text, ids in given
    ]


async def completion_events(run: Run, body: CompletionRequest) -> AsyncIterator[JsonObject]:
    ctx = run.ctx
    base = header(run, body, "text_completion")
    echoed = await ctx.on_tokenizer_thread(_echo_texts, run) if body.echo else []
    # text_offset of each choice's next token, from its first output on. Under echo with
    # logprobs the prompt's tokens come first, their offsets summed over their texts as vLLM
    # does, so the output continues from that sum (which differs from the echoed text's length
    # where one character spans several tokens, each shown alone as U+FFFD).
    offsets: dict[int, int] = {}
    # echo: the prompt goes first; with logprobs it waits for the choice's first output, which
    # brings the prompt's logprobs.
    scored_echo = body.echo and body.logprobs is not None
    if body.echo and not scored_echo:
        for choice in run.choices:
            yield chunk(base, choice.index, text=echoed[choice.prompt_index], logprobs=None)
    async for event in run.events():
        choice, output = event.choice, event.output
        if scored_echo and choice.index not in offsets:
            prompt = run.prompts[choice.prompt_index]
            scored = [None, *output.prompt_logprobs]
            echo, offsets[choice.index] = _legacy_logprobs(ctx, prompt, scored, 0)
            yield chunk(base, choice.index, text=echoed[choice.prompt_index], logprobs=echo)
        logprobs = None
        if output.logprobs:  # only when asked for
            ids = [lp.token_id for lp in output.logprobs]
            offset = offsets.get(choice.index, 0)
            logprobs, offsets[choice.index] = _legacy_logprobs(ctx, ids, output.logprobs, offset)
        if output.text or output.finish_reason is not None or logprobs is not None:
            yield choice_chunk(run, base, event, text=output.text, logprobs=logprobs)
    if body.stream_usage or not body.stream:
        yield {**base, "choices": [], "usage": usage_dict(run)}


def fold_completion(chunks: list[JsonObject], with_logprobs: bool) -> JsonObject:
    """The chunks of a completions stream as one text_completion (the non-streaming reply)."""
    reply = fold(chunks, "text_completion")
    for choice in reply["choices"]:
        if with_logprobs and choice["logprobs"] is None:  # a table even when no chunk had one
            choice["logprobs"] = {key: [] for key in LOGPROB_KEYS}
    return reply


router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    body = await CompletionRequest.from_request(request)
    run = await Run(request, body.to_api(), new_id("cmpl")).start()
    return await respond(
        run,
        completion_events(run, body),
        body.stream,
        functools.partial(fold_completion, with_logprobs=body.logprobs is not None),
    )
