"""OpenAI's embeddings: POST /v1/embeddings. Every model embeds, as --pooling or its
sentence-transformers config says (minisgl.pooling); each input is a prompt the scheduler
computes and pools, sampling nothing (docs/server.md, "Embeddings")."""

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
from minisgl.pooling import input_token_ids


class EmbeddingRequest(WireModel):
    input: str | FailFastList[str] | FailFastList[int] | FailFastList[FailFastList[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: a model's config.json says which (Pooling)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the last N tokens


async def _embeddings(run: Run, base64_format: bool) -> AsyncIterator[JsonObject]:
    # An embedding request's one output is its end: with the vector, or aborted (the server is
    # stopping).
    async for event in run.events():
        if (vector := event.output.embedding) is None:
            raise ChoiceFailed("the request ended before its embedding was made", True)
        embedding = (
            base64.b64encode(vector).decode()
            if base64_format
            else np.frombuffer(vector, "<f4").tolist()
        )
        yield {"object": "embedding", "index": event.choice.index, "embedding": embedding}


def _reply(run: Run, items: list[JsonObject]) -> JsonObject:
    num_tokens = run.usage()[0]
    return {
        "object": "list",
        "data": sorted(items, key=lambda item: item["index"]),
        "model": run.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    body = await EmbeddingRequest.from_request(request)
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)  # before any tokenizing, as Run.prepare does
    pooling = ctx.pooling.cut(body.dimensions)
    prompts = await ctx.on_tokenizer_thread(
        input_token_ids, body.input, ctx.tokenizer.encode, ctx.limits, body.truncate_prompt_tokens
    )
    sampling = {"max_tokens": 0, "pooling": pooling, "user": body.user}
    api_request = ApiRequest(prompts, sampling, {"prompt": "input"}, 1, body.model)
    run = await Run(request, api_request, new_id("embd")).start()
    vectors = _embeddings(run, body.encoding_format == "base64")
    return await respond(run, vectors, False, functools.partial(_reply, run))
