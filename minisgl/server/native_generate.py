"""SGLang's native generation endpoint, POST /generate: what SGLang clients and tools send
(`sglang.bench_serving --backend sglang`, scripts written for SGLang's runtime) and what the
SGLang Model Gateway forwards to a worker's /generate.

Request (SGLang's GenerateReqInput, the parts minisgl serves):
- `text` (a string or a list) or `input_ids` (a list of ids or a list of lists): one prompt or a
  batch;
- `sampling_params`: an object (or one per prompt) with SGLang's names: `max_new_tokens`
  (default 128), `min_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, the penalties, `stop`,
  `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `n`, `sampling_seed`,
  `logit_bias`, and the constraints `json_schema`, `regex`, `ebnf`; unknown names are ignored,
  as elsewhere;
- `stream`, `return_logprob`, `top_logprobs_num`, `logprob_start_len` (-1: output only; k >= 0:
  also the prompt's from position k, as prompt logprobs), `rid` (the meta_info id: one, or a
  list with one per prompt).

Response, per sequence: `{"text", "output_ids", "meta_info"}`, a list of them for a batch or
n > 1. meta_info: `id`, `finish_reason` (null, or `{"type": "stop", "matched": ...}` /
`{"type": "length", "length": max_new_tokens}` / `{"type": "abort", ...}`), `prompt_tokens`,
`completion_tokens`, `cached_tokens`, `e2e_latency` (seconds, at the end), and with logprobs
`output_token_logprobs` ([logprob, id, null] per token), `output_top_logprobs`,
`input_token_logprobs`, `input_top_logprobs`. Streams are server-sent events whose `text` and
`output_ids` are cumulative (SGLang's default), ending with `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import PrivateAttr, ValidationError, model_validator
from starlette.responses import JSONResponse, Response

from minisgl.chat import constraint_from_fields
from minisgl.core import MAX_LOGPROBS, FinishReason, InvalidRequestError, TokenLogprob
from minisgl.server.generation import (
    ChoiceState,
    GenerationGroup,
    RequestError,
    ServingContext,
    invalid_request,
    stream_response,
)
from minisgl.server.protocol import OpenAIRequest, SamplingFields, new_id
from minisgl.server.serving_completion import tokenize_prompts
from minisgl.server.sse import SSE_DONE, sse_event

# SGLang's default when sampling_params has no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's names for the fields that SamplingFields calls otherwise.
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}


class NativeSamplingParams(SamplingFields):
    """SGLang's `sampling_params` object, read as the shared sampling fields (so every rule and
    message of the OpenAI endpoints applies). Logprob settings come from the request."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int | None = None
    sampling_seed: int | None = None
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    _logprobs: int | None = PrivateAttr(default=None)
    _prompt_logprobs: int | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _from_sglang_names(self) -> NativeSamplingParams:
        if self.sampling_seed is not None:
            self.seed = self.sampling_seed
        if self.min_new_tokens is not None:
            self.min_tokens = self.min_new_tokens
        if self.no_stop_trim:
            self.include_stop_str_in_output = True
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_new_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self._logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Also 0 for max_new_tokens 0 without logprobs: SGLang's prefill-only request runs as
        one that scores its prompt (the only kind that may generate nothing)."""
        if self._prompt_logprobs is None and self.max_new_tokens == 0:
            return 0
        return self._prompt_logprobs

    def wire_param(self, name: str) -> str:
        """A sampling field as `sampling_params.<SGLang's name>`; the prompt's fields (`text`,
        `input_ids`) and logprob settings live at the request's top level."""
        if name in ("logprobs", "prompt_logprobs"):
            return "top_logprobs_num"
        if name in type(self).model_fields or name == "constraint":
            return "sampling_params." + _SGLANG_NAMES.get(name, name)
        return name


class GenerateRequest(OpenAIRequest):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | list[str] | None = None  # one id, or one per prompt of a batch

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("text", "give exactly one of text and input_ids")
        if isinstance(self.rid, list) and len(self.rid) != len(self.prompts()):
            raise InvalidRequestError("rid", "a list of ids needs one id per prompt")
        if not 0 <= self.top_logprobs_num <= MAX_LOGPROBS:
            raise InvalidRequestError("top_logprobs_num", f"must be in [0, {MAX_LOGPROBS}]")
        if self.logprob_start_len < -1:
            raise InvalidRequestError("logprob_start_len", "must be -1 (output only) or >= 0")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids or []
        return bool(ids) and isinstance(ids[0], list)

    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        ids = self.input_ids or []
        if self.is_batch:
            return cast("list[list[int]]", ids)
        return [cast("list[int]", ids)]

    def sampling_for(self, num_prompts: int) -> list[NativeSamplingParams]:
        """One NativeSamplingParams per prompt; a 400 (RequestValidationError) if one is bad."""
        given = self.sampling_params
        rows = given if isinstance(given, list) else [given or {}] * num_prompts
        if len(rows) != num_prompts:
            raise InvalidRequestError("sampling_params", "needs one object per prompt")
        out = []
        for row in rows:
            try:
                fields = NativeSamplingParams.model_validate(row)
            except ValidationError as exc:  # reported as the body's own errors are
                raise RequestValidationError(
                    [{**e, "loc": ("sampling_params", *e["loc"])} for e in exc.errors()]
                ) from None
            if self.return_logprob:
                fields._logprobs = self.top_logprobs_num
                if self.logprob_start_len >= 0:
                    fields._prompt_logprobs = self.top_logprobs_num
            out.append(fields)
        return out


def _finish_reason(choice: ChoiceState, max_new_tokens: int) -> dict[str, Any] | None:
    reason = choice.finish_reason
    if reason is None:
        return None
    if reason == FinishReason.LENGTH:
        return {"type": "length", "length": max_new_tokens}
    if reason == FinishReason.STOP:  # the stop string, or the token id (EOS included)
        return {"type": "stop", "matched": choice.matched_stop}
    return {"type": "abort", "message": choice.error or reason.value}


def _triples(entries: list[TokenLogprob]) -> tuple[list[list[Any]], list[list[list[Any]]]]:
    """SGLang's logprob layout: [logprob, token id, text (null: not asked)] per token, and the
    top alternatives of each as a list of such triples."""
    chosen = [[lp.logprob, lp.token_id, None] for lp in entries]
    top = [[[tlp, tid, None] for tid, tlp in lp.top] for lp in entries]
    return chosen, top


class _Responder:
    """Turns a group's choices into SGLang's response objects."""

    def __init__(
        self, body: GenerateRequest, group: GenerationGroup, max_new_tokens: list[int]
    ) -> None:
        self.body = body
        self.group = group
        self.max_new_tokens = max_new_tokens  # per prompt, resolved
        self.start_s = time.perf_counter()

    def rid_of(self, choice: ChoiceState) -> str:
        """The client's id for this sequence's prompt (a list gives one per prompt), else ours."""
        rid = self.body.rid
        if isinstance(rid, list):
            return rid[choice.prompt_index]
        return rid or choice.rid

    def meta_info(self, choice: ChoiceState) -> dict[str, Any]:
        prompt = self.group.prompts[choice.prompt_index]
        meta: dict[str, Any] = {
            "id": self.rid_of(choice),
            "finish_reason": _finish_reason(choice, self.max_new_tokens[choice.prompt_index]),
            "prompt_tokens": len(prompt),
            "completion_tokens": choice.num_tokens,
            "cached_tokens": choice.num_cached_prompt_tokens,
        }
        if choice.finished:
            meta["e2e_latency"] = time.perf_counter() - self.start_s
        if self.body.return_logprob:
            chosen, top = _triples(choice.logprobs)
            meta["output_token_logprobs"], meta["output_top_logprobs"] = chosen, top
            start = self.body.logprob_start_len
            in_chosen: list[list[Any]] = []
            in_top: list[Any] = []
            if start >= 0:
                scored, scored_top = _triples(choice.prompt_logprobs)
                in_chosen = [[None, prompt[0], None], *scored]  # nothing comes before it
                in_top = [None, *scored_top]
            meta["input_token_logprobs"] = in_chosen[max(start, 0) :]
            meta["input_top_logprobs"] = in_top[max(start, 0) :]
        return meta

    def item(self, choice: ChoiceState) -> dict[str, Any]:
        out: dict[str, Any] = {"text": choice.text, "output_ids": list(choice.token_ids)}
        out["meta_info"] = self.meta_info(choice)
        if self.many:
            out["index"] = choice.index
        return out

    @property
    def many(self) -> bool:
        return self.body.is_batch or self.group.num_choices_per_prompt > 1


async def generate(ctx: ServingContext, body: GenerateRequest, request: Request) -> Response:
    prompts_in = body.prompts()
    if not prompts_in:
        raise RequestError(400, "text: must not be empty", param="text")
    try:
        sampling = body.sampling_for(len(prompts_in))
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param=exc.param) from None
    n = sampling[0].n
    if any(s.n != n for s in sampling):
        raise RequestError(400, "sampling_params.n: must be the same for every prompt")
    ctx.check_fan_out(len(prompts_in), n)
    ctx.check_capacity(len(prompts_in) * n)
    prompt_param = "text" if body.text is not None else "input_ids"
    try:  # one grammar per request (every choice shares it), as on the OpenAI endpoints
        found = {constraint_from_fields(f.constraint_fields) for f in sampling}
    except InvalidRequestError as exc:
        raise invalid_request(exc, sampling[0]) from None
    if len(found) > 1:
        raise RequestError(400, "sampling_params: every prompt needs the same constraint")
    constraint = found.pop()
    blob = None
    if constraint is not None:
        try:
            blob = await ctx.off_loop(ctx.compile_constraint, constraint[1], constraint[0])
        except InvalidRequestError as exc:
            raise invalid_request(exc, sampling[0]) from None
    prompts, _ = await ctx.off_loop(tokenize_prompts, ctx, prompts_in)
    shortest = min(len(ids) for ids in prompts)
    if body.return_logprob and body.logprob_start_len >= max(shortest, 1):
        message = f"logprob_start_len: must be below the prompt's length ({shortest} tokens)"
        raise RequestError(400, message, param="logprob_start_len")
    params = [
        ctx.sampling_params_for(fields, ids, prompt_param, constraint and constraint[1])
        for fields, ids in zip(sampling, prompts, strict=True)
    ]
    group = GenerationGroup(ctx, new_id("generate"), prompts, params, blob)
    responder = _Responder(body, group, [row[0].max_tokens for row in params])
    group.start(request)
    if body.stream:
        return stream_response(_stream(group, responder), group.choices[0].rid)
    early = await group.collect()
    if early is not None:
        return early
    items = [responder.item(choice) for choice in group.choices]
    return JSONResponse(items if responder.many else items[0])


async def _stream(group: GenerationGroup, responder: _Responder) -> AsyncIterator[str]:
    try:
        async for choice, _ in group.stream_outputs():
            yield sse_event(responder.item(choice))
        yield SSE_DONE
    finally:
        group.close()  # early exits (disconnect, timeout, error) abort what is unfinished


def install_generate_route(app: FastAPI) -> None:
    async def generate_route(body: GenerateRequest, request: Request) -> Response:
        return await generate(request.app.state.ctx, body, request)

    app.add_api_route("/generate", generate_route, methods=["POST", "PUT"])
