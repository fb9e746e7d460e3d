"""SGLang's native API: POST /generate, and the worker endpoints (/server_info, /model_info,
/get_load, /flush_cache, /health_generate) that make a minisgl server a worker of the SGLang
Model Gateway and of tools written for SGLang. Field names and meanings follow SGLang's
http_server.py, stating only what minisgl can state truthfully (never the API key); the
reference is docs/server.md#sglangs-generate and docs/scaling.md#what-the-gateway-reads."""

import asyncio
import contextlib
import importlib.metadata
import json
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any, cast

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import Response

from minisgl.api.dialects.openai import OpenAISampling
from minisgl.api.errors import RequestError
from minisgl.api.pipeline import Choice, Run, ServingContext
from minisgl.api.request import (
    SAMPLING_NAMES,
    ApiRequest,
    FailFastList,
    JsonObject,
    WireModel,
    new_id,
    sampling_of,
)
from minisgl.api.sse import respond
from minisgl.chat.requests import CONSTRAINT_FIELDS
from minisgl.config import ServerArgs
from minisgl.core import FinishReason, ReqOutput, SamplingParams, TokenLogprob
from minisgl.limits import DEFAULT_GENERATE_MAX_NEW_TOKENS, MAX_LOGPROBS, InvalidRequestError
from minisgl.runtime.engine_client import BackendUnavailable
from minisgl.runtime.messages import TokenizedRequest

ALIASES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
# Every rule on a sampling field is reported under `sampling_params.<SGLang's name>`.
WIRE_NAMES = {
    **{name: f"sampling_params.{name}" for name in (*SAMPLING_NAMES, *CONSTRAINT_FIELDS)},
    **{name: f"sampling_params.{wire}" for wire, name in ALIASES.items()},
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
}
# /get_load: how long to wait for fresh scheduler stats.
LOAD_STATS_TIMEOUT_S = 1.0
# /health_generate: the engine must produce output within this long (SGLang waits 20 s: under a
# long prefill the probe's own token can take that long on a busy GPU).
HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_GENERATE_POLL_S = 0.05
# The probe's one-token prompt: id 0 exists in every vocabulary (SGLang sends the same).
HEALTH_PROMPT = (0,)
HEALTH_PARAMS = SamplingParams(max_tokens=1, temperature=0)
# /flush_cache: the scheduler answers between steps (a long prefill step can take seconds).
FLUSH_CACHE_TIMEOUT_S = 30.0
# /server_info's fields that are the server's flags, by the same names.
SERVER_INFO_ARGS = ("page_size", "tp_size", "nnodes", "max_running_requests", "max_queued_requests")
CONFIG_FILE = "config.json"


class SGLangSampling(OpenAISampling):
    """SGLang's `sampling_params` object (logprob settings come from the request)."""

    max_new_tokens: int | None = DEFAULT_GENERATE_MAX_NEW_TOKENS
    min_new_tokens: int | None = None
    sampling_seed: int | None = None
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output


class GenerateRequest(WireModel):
    text: str | FailFastList[str] | None = None
    input_ids: FailFastList[int] | FailFastList[FailFastList[int]] | None = None
    sampling_params: JsonObject | list[JsonObject] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1)  # -1: output only
    rid: str | list[str] | None = None  # one id, or one per prompt of a batch
    priority: int | None = None  # SGLang's place for it (sampling_params.priority works too)

    @property
    def is_batch(self) -> bool:
        """A list of texts, or of id lists (exactly one of text and input_ids is set)."""
        ids = self.input_ids
        return isinstance(self.text, list) or bool(ids) and isinstance(ids[0], list)  # type: ignore[index]

    def to_api(self) -> ApiRequest:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("text", "give exactly one of text and input_ids")
        given = self.text if self.text is not None else self.input_ids
        prompts = cast("list[str] | list[list[int]]", given if self.is_batch else [given])
        if not prompts:
            raise InvalidRequestError("text", "must not be empty")
        if isinstance(self.rid, list) and len(self.rid) != len(prompts):
            raise InvalidRequestError("rid", "a list of ids needs one id per prompt")
        # One object per prompt, or one that every prompt shares (validated once: a batch of
        # millions of prompts is refused by its size, not after millions of validations).
        per_prompt = self.sampling_params
        if isinstance(per_prompt, list) and len(per_prompt) != len(prompts):
            raise InvalidRequestError("sampling_params", "needs one object per prompt")
        rows = [
            SGLangSampling.validated(row, "sampling_params")
            for row in (per_prompt if isinstance(per_prompt, list) else [per_prompt or {}])
        ]
        if any(row.n != rows[0].n for row in rows):
            raise InvalidRequestError("sampling_params.n", "must be the same for every prompt")
        constraint_fields = rows[0].constraint_fields
        if any(row.constraint_fields != constraint_fields for row in rows):  # one grammar for all
            raise InvalidRequestError("sampling_params", "every prompt needs the same constraint")
        logprobs = self.top_logprobs_num if self.return_logprob else None
        scored = self.return_logprob and self.logprob_start_len >= 0
        sampling: list[JsonObject] = []
        for row in rows:
            # max_new_tokens 0 without logprobs: SGLang's prefill-only request runs as one that
            # scores its prompt (the only kind that may generate nothing).
            prefill_only = 0 if row.max_new_tokens == 0 else None
            fields, _ = sampling_of(
                row,
                ALIASES,
                priority=self.priority,
                logprobs=logprobs,
                prompt_logprobs=self.top_logprobs_num if scored else prefill_only,
            )
            sampling.append({**fields, "max_tokens": row.max_new_tokens})  # SGLang's name decides
        wire_names = {**WIRE_NAMES, "prompt": "text" if self.text is not None else "input_ids"}
        shared = sampling if isinstance(per_prompt, list) else sampling[0]
        return ApiRequest(prompts, shared, wire_names, rows[0].n, None, constraint_fields)


def _finish_reason(choice: Choice, max_new_tokens: int) -> JsonObject | None:
    if (reason := choice.finish_reason) is None:
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
    return chosen, [[[tlp, tid, None] for tid, tlp in lp.top] for lp in entries]


def _item(run: Run, body: GenerateRequest, choice: Choice) -> JsonObject:
    """One sequence as SGLang reports it, so far (its text and ids are cumulative)."""
    prompt = run.prompts[choice.prompt_index]
    rid = body.rid[choice.prompt_index] if isinstance(body.rid, list) else body.rid
    meta: JsonObject = {
        "id": rid or choice.rid,
        "finish_reason": _finish_reason(choice, run.params[choice.index].max_tokens),
        "prompt_tokens": len(prompt),
        "completion_tokens": choice.num_tokens,
        "cached_tokens": choice.num_cached_prompt_tokens,
    }
    if choice.finished:
        meta["e2e_latency"] = time.perf_counter() - run.arrival_time_s
    if body.return_logprob:
        meta["output_token_logprobs"], meta["output_top_logprobs"] = _triples(choice.logprobs)
        scored, scored_top = _triples(choice.prompt_logprobs)
        # The first prompt token has no logprob: nothing comes before it. -1: the output's only.
        start = body.logprob_start_len if body.logprob_start_len >= 0 else len(prompt)
        meta["input_token_logprobs"] = [[None, prompt[0], None], *scored][start:]
        meta["input_top_logprobs"] = [None, *scored_top][start:]
    # In a list reply (a batch, or n > 1) each item says which sequence it is.
    return {
        "text": choice.text,
        "output_ids": list(choice.token_ids),
        "meta_info": meta,
        **({"index": choice.index} if body.is_batch or run.req.n > 1 else {}),
    }


async def generate_events(run: Run, body: GenerateRequest) -> AsyncIterator[JsonObject]:
    async for event in run.events():
        # Each item is cumulative: a reply needs only each sequence's last.
        if body.stream or event.choice.finished:
            yield _item(run, body, event.choice)


def fold_generate(items: list[JsonObject]) -> JsonObject | list[Any]:
    last = {item.get("index", 0): item for item in items}
    ordered = [last[i] for i in sorted(last)]
    return ordered if "index" in ordered[0] else ordered[0]  # the items of a list reply say so


router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    body = await GenerateRequest.from_request(request)
    run = Run(request, body.to_api(), new_id("generate"))
    await run.prepare()
    shortest = min(map(len, run.prompts))
    if body.return_logprob and body.logprob_start_len >= max(shortest, 1):
        raise InvalidRequestError(
            "logprob_start_len", f"must be below the prompt's length ({shortest} tokens)"
        )
    run.submit()
    return await respond(run, generate_events(run, body), body.stream, fold_generate)


def _reported_path(given: str | None, resolved: str) -> str:
    """As SGLang reports it: a hub id as typed (another machine's gateway can fetch it), a local
    folder as an absolute path (a relative one means nothing to another process's cwd)."""
    # None: the bundled default model, of which only the converted folder exists.
    if given is None or Path(given).expanduser().is_dir():
        return str(Path(given or resolved).expanduser().resolve())
    return given


def model_info(args: ServerArgs, model_path: str, tokenizer_path: str) -> JsonObject:
    """GET /model_info: the checkpoint, fixed for the server's life. `model_path` and
    `tokenizer_path` are the resolved local folders the server loads from."""
    config: JsonObject = {}
    with contextlib.suppress(OSError, ValueError):  # the scheduler reports a broken config
        config = json.loads((Path(model_path) / CONFIG_FILE).read_text())
    return {
        "model_path": _reported_path(args.model, model_path),
        # Without --tokenizer, tokenizer_path is model_path: reported as the model is.
        "tokenizer_path": _reported_path(args.tokenizer or args.model, tokenizer_path),
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures") or [],
    }


def _version() -> str:
    try:
        return importlib.metadata.version("minisgl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


async def _engine_answers(ctx: ServingContext) -> bool:
    """True once the engine produces any output after the call, its own or another request's
    (like SGLang, output of any request proves the engine runs). A one-token greedy probe is
    submitted only to an idle engine, so probes never fill the queue (--max-queued-requests)."""
    loop = asyncio.get_running_loop()
    sent_s = loop.time()
    rid = new_id("health")
    queue: asyncio.Queue = asyncio.Queue()
    try:
        if not ctx.engine.num_active_requests:
            ctx.engine.submit(TokenizedRequest(rid, HEALTH_PROMPT, HEALTH_PARAMS), queue)
        while loop.time() - sent_s < HEALTH_GENERATE_TIMEOUT_S:
            with contextlib.suppress(asyncio.TimeoutError):
                item = await asyncio.wait_for(queue.get(), HEALTH_GENERATE_POLL_S)
                failed = (FinishReason.ERROR, FinishReason.ABORT)  # proves nothing
                return isinstance(item, ReqOutput) and item.finish_reason not in failed
            if ctx.engine.last_output_s > sent_s:
                return True
        return False
    except BackendUnavailable:  # shutting down, or the backend stopped
        return False
    finally:
        ctx.engine.abort(rid)  # a no-op once it finished, or if it was never sent


@router.get("/server_info")
@router.get("/get_server_info")  # SGLang's old name too
def server_info(request: Request) -> JsonObject:
    ctx, info = request.app.state.ctx, request.app.state.model_info
    return {
        **{key: info[key] for key in ("model_path", "tokenizer_path", "is_generation")},
        "served_model_name": ctx.served_model_name,
        "context_length": ctx.limits.max_model_len,
        # The KV pool, in tokens; a request's prompt can be at most max_req_input_len.
        "max_total_num_tokens": ctx.limits.kv_capacity_tokens,
        "max_req_input_len": ctx.limits.max_seq_len - 1,
        "disable_radix_cache": ctx.args.cache_type != "radix",
        "dp_size": 1,  # a minisgl server is one data-parallel rank; replicas are separate workers
        **{name: getattr(ctx.args, name) for name in SERVER_INFO_ARGS},
        "version": _version(),
    }


@router.get("/model_info")
@router.get("/get_model_info")
def get_model_info(request: Request) -> JsonObject:
    return request.app.state.model_info


@router.get("/get_load")
async def get_load(request: Request) -> list[JsonObject]:
    ctx = request.app.state.ctx
    stats = (await ctx.engine.stats(LOAD_STATS_TIMEOUT_S, required=True)).stats
    return [
        {
            "dp_rank": 0,  # the server's one rank (replicas are separate workers)
            "num_reqs": stats.num_running_reqs + stats.num_queue_reqs,
            "num_waiting_reqs": stats.num_queue_reqs,
            "num_waiting_reqs_by_priority": stats.num_queue_reqs_by_priority,
            # KV tokens held by running requests (cached prefixes nobody uses are free to evict and
            # do not count); prompts still waiting are not counted.
            "num_tokens": (stats.num_total_pages - stats.num_free_pages) * ctx.args.page_size,
        }
    ]


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    reply = await request.app.state.ctx.engine.flush_cache(FLUSH_CACHE_TIMEOUT_S)
    if not reply.flushed:
        raise RequestError(HTTPStatus.BAD_REQUEST, reply.message)
    return Response("Cache flushed.\n", media_type="text/plain")


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    return Response(
        status_code=200
        if (await _engine_answers(request.app.state.ctx))
        else HTTPStatus.SERVICE_UNAVAILABLE
    )
