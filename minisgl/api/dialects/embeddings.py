"""OpenAI's embeddings: POST /v1/embeddings. Every model embeds, as --pooling or its
sentence-transformers config says (minisgl.pooling); each input is a prompt the scheduler
computes and pools, sampling nothing (docs/server.md, "Embeddings")."""

from __future__ import annotations

import base64
import functools
from collections.abc import AsyncIterator
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import Response

from minisgl.api.errors import ChoiceFailed
from minisgl.api.pipeline import Run, ServingContext
from minisgl.api.request import ApiRequest, FailFastList, JsonObject, WireModel, new_id
from minisgl.api.sse import respond
from minisgl.limits import InvalidRequestError, check_prompt_size, check_token_ids


class EmbeddingRequest(WireModel):
    input: str | FailFastList[str] | FailFastList[int] | FailFastList[FailFastList[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: no model served here declares it
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the last N tokens


def _token_ids(ctx: ServingContext, inputs: list, keep_len: int | None) -> list[list[int]]:
    """On the tokenizer thread: each input as token ids, its last `keep_len` (vLLM's
    truncate_prompt_tokens) if given, each checked (a 400 names its index)."""
    prompts = []
    for i, item in enumerate(inputs):
        ids = ctx.tokenizer(item)["input_ids"] if isinstance(item, str) else item
        prompts.append(ids := ids[-(keep_len or len(ids)) :])
        if not item or len(ids) > ctx.limits.max_seq_len:
            message = f"must be 1 to {ctx.limits.max_seq_len} tokens long, not {len(ids)}"
            raise InvalidRequestError(f"input[{i}]", message)
        check_token_ids(ids, ctx.limits, f"input[{i}]")
    return prompts


async def _embeddings(run: Run, base64_format: bool) -> AsyncIterator[JsonObject]:
    async for event in run.events():
        if (vector := event.output.embedding) is not None:
            data = base64.b64encode(vector).decode() if base64_format else None
            embedding = data or np.frombuffer(vector, "<f4").tolist()
            yield {"object": "embedding", "index": event.choice.index, "embedding": embedding}
        elif event.output.finish_reason is not None:  # aborted: the server is stopping
            raise ChoiceFailed("the request ended before its embedding was made", True)


def _reply(run: Run, items: list[JsonObject]) -> JsonObject:
    num_tokens = run.usage()[0]
    return {
        "object": "list",
        "data": sorted(items, key=lambda item: item["index"]),
        "model": run.req.model or run.ctx.served_model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    body = await EmbeddingRequest.from_request(request)
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    if body.dimensions is not None:
        raise InvalidRequestError("dimensions", "this model does not support Matryoshka dimensions")
    items = body.input
    inputs = [items] if isinstance(items, str) or items and isinstance(items[0], int) else items
    if not inputs:
        raise InvalidRequestError("input", "must not be empty")
    if body.truncate_prompt_tokens is None:  # before tokenizing: certainly too long
        check_prompt_size([t for t in inputs if isinstance(t, str)], 0, ctx.limits, "input")
    prompts = await ctx.on_tokenizer_thread(_token_ids, ctx, inputs, body.truncate_prompt_tokens)
    sampling = {"max_tokens": 0, "pooling": ctx.pooling, "user": body.user}
    api_request = ApiRequest(prompts, sampling, {"prompt": "input"}, 1, body.model)
    run = await Run(request, api_request, new_id("embd")).start()
    vectors = _embeddings(run, body.encoding_format == "base64")
    return await respond(run, vectors, False, functools.partial(_reply, run))
