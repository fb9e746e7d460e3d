"""SGLang's native worker endpoints, so a minisgl server is a first-class worker of the SGLang
Model Gateway (`pip install sglang-router`, command `smg`) and of tools written for SGLang.

What the gateway (sglang-router 0.3.x) reads when it registers a worker, and what for:
- GET /server_info (falling back to /get_server_info): `served_model_name` becomes the model id
  of the worker (the gateway's own /v1/models lists it); `model_path` is where the gateway loads
  the model's tokenizer from (a local folder or a hub id); `tp_size`, `dp_size` become labels.
- GET /model_info (falling back to /get_model_info): `model_type`, `architectures` (labels);
  newer gateways also take `tokenizer_path` from here.
- GET /get_load: one entry per data-parallel rank (a minisgl server is one rank) with the tokens
  it holds; the power_of_two policy balances on it.
- GET /health_generate: SGLang's deep health check (the engine still produces tokens), for
  `smg --health-check-endpoint /health_generate` and load balancers.
- GET/POST /flush_cache: empty the prefix cache when idle (the gateway sends it to every
  worker; `sglang.bench_serving --flush-cache` calls it).
POST /generate, SGLang's native generation, lives in minisgl/server/native_generate.py.

Field names and meanings follow SGLang's http_server.py. Only what minisgl can state truthfully
is present: e.g. never the API key, which SGLang's /get_server_info echoes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from minisgl.config import ServerArgs
from minisgl.core import FinishReason, SamplingParams
from minisgl.models.names import served_model_name
from minisgl.runtime.engine_client import BackendUnavailable, RoutedOutput
from minisgl.server.errors import HTTP_BAD_REQUEST, HTTP_SERVICE_UNAVAILABLE
from minisgl.server.generation import ServingContext
from minisgl.server.protocol import error_dict, new_id

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
# Each minisgl server is a single data-parallel rank; replicas are separate workers.
DP_RANK = 0
DP_SIZE = 1
CONFIG_FILE = "config.json"
# A probe that ends like this proves nothing about the engine.
_FAILED = (FinishReason.ERROR, FinishReason.ABORT)
PACKAGE_NAME = "minisgl"


@dataclass(frozen=True)
class ModelCard:
    """What the worker endpoints say about the checkpoint: fixed for the server's life."""

    model_path: str
    tokenizer_path: str
    model_type: str | None
    architectures: tuple[str, ...]


def _reported_path(given: str | None, resolved: str) -> str:
    """As SGLang reports it: a hub id as typed (another machine's gateway can fetch it), a local
    folder as an absolute path (a relative one means nothing to another process's cwd)."""
    if given is None:  # the bundled default model: only its converted folder exists
        return str(Path(resolved).resolve())
    if Path(given).expanduser().is_dir():
        return str(Path(given).expanduser().resolve())
    return given


def build_model_card(args: ServerArgs, model_path: str, tokenizer_path: str) -> ModelCard:
    """`model_path` / `tokenizer_path`: the resolved local folders the server loads from."""
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # the scheduler reports a broken config
        config = json.loads((Path(model_path) / CONFIG_FILE).read_text())
    reported_model = _reported_path(args.model, model_path)
    return ModelCard(
        model_path=reported_model,
        tokenizer_path=_reported_path(args.tokenizer, tokenizer_path)
        if args.tokenizer
        else reported_model,
        model_type=config.get("model_type"),
        architectures=tuple(config.get("architectures") or ()),
    )


def _version() -> str:
    try:
        return importlib.metadata.version(PACKAGE_NAME)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _unavailable(message: str) -> JSONResponse:
    body = error_dict(message, "server_error", code=HTTP_SERVICE_UNAVAILABLE)
    return JSONResponse(body, status_code=HTTP_SERVICE_UNAVAILABLE)


async def _engine_answers(ctx: ServingContext, timeout_s: float) -> bool:
    """Submit a one-token greedy request; True once the engine produces any output after it was
    sent, its own or another request's (a busy server may queue the probe behind real work:
    like SGLang, output of any request proves the engine runs)."""
    loop = asyncio.get_running_loop()
    sent_s = loop.time()
    rid = new_id("health")
    queue: asyncio.Queue = asyncio.Queue()
    try:
        ctx.engine.submit(rid, 0, list(HEALTH_PROMPT), HEALTH_PARAMS, queue)
    except BackendUnavailable:  # shutting down, or the backend stopped
        return False
    try:
        while loop.time() - sent_s < timeout_s:
            with contextlib.suppress(asyncio.TimeoutError):
                item = await asyncio.wait_for(queue.get(), HEALTH_GENERATE_POLL_S)
                return isinstance(item, RoutedOutput) and (item.output.finish_reason not in _FAILED)
            if ctx.engine.last_output_s > sent_s:
                return True
        return False
    finally:
        ctx.engine.abort(rid)  # a no-op once it finished


def install_native_routes(app: FastAPI, args: ServerArgs, card: ModelCard) -> None:
    def ctx_of(request: Request) -> ServingContext:
        return request.app.state.ctx

    def server_info(ctx: ServingContext) -> dict[str, Any]:
        return {
            "model_path": card.model_path,
            "tokenizer_path": card.tokenizer_path,
            "served_model_name": served_model_name(args),
            "is_generation": True,
            "context_length": ctx.limits.max_model_len,
            # The KV pool, in tokens; a request's prompt can be at most max_req_input_len.
            "max_total_num_tokens": ctx.limits.kv_capacity_tokens,
            "max_req_input_len": ctx.limits.max_seq_len - 1,
            "page_size": args.page_size,
            "disable_radix_cache": args.cache_type != "radix",
            "tp_size": args.tp_size,
            "dp_size": DP_SIZE,
            "nnodes": args.nnodes,
            "max_running_requests": args.max_running_requests,
            "max_queued_requests": args.max_queued_requests,
            "version": _version(),
        }

    def model_info() -> dict[str, Any]:
        return {
            "model_path": card.model_path,
            "tokenizer_path": card.tokenizer_path,
            "is_generation": True,
            "model_type": card.model_type,
            "architectures": list(card.architectures),
        }

    @app.get("/server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        return server_info(ctx_of(request))

    app.add_api_route("/get_server_info", get_server_info, methods=["GET"])  # SGLang's old name

    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info()

    app.add_api_route("/get_model_info", get_model_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        reply = await ctx_of(request).engine.stats(LOAD_STATS_TIMEOUT_S)
        if reply is None:
            return _unavailable("The scheduler did not answer.")
        stats = reply.stats
        used_pages = stats.num_total_pages - stats.num_free_pages
        load = {
            "dp_rank": DP_RANK,
            "num_reqs": stats.num_running_reqs + stats.num_queue_reqs,
            "num_waiting_reqs": stats.num_queue_reqs,
            # KV tokens held by running requests (cached prefixes nobody uses are free to evict
            # and do not count); prompts still waiting are not counted.
            "num_tokens": used_pages * args.page_size,
        }
        return JSONResponse([load])

    async def flush_cache(request: Request) -> Response:
        reply = await ctx_of(request).engine.flush_cache(FLUSH_CACHE_TIMEOUT_S)
        if reply is None:
            return _unavailable("The scheduler did not answer.")
        if not reply.flushed:
            body = error_dict(reply.message, param=None, code=HTTP_BAD_REQUEST)
            return JSONResponse(body, status_code=HTTP_BAD_REQUEST)
        return Response("Cache flushed.\n", media_type="text/plain")

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        ok = await _engine_answers(ctx_of(request), HEALTH_GENERATE_TIMEOUT_S)
        return Response(status_code=200 if ok else HTTP_SERVICE_UNAVAILABLE)
