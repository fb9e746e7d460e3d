"""vLLM's (and SGLang's) POST /tokenize and /detokenize, and vLLM's GET /tokenizer_info: a
prompt or chat messages counted exactly as a request would cost them, ids back to text, the
special tokens and chat template (what lm-evaluation-harness's remote tokenizer needs)."""

from typing import Any, cast

from fastapi import APIRouter, Request
from pydantic import Field

from minisgl.api.pipeline import Run, ServingContext
from minisgl.api.request import ApiRequest, FailFastList, JsonObject, WireModel
from minisgl.chat import ChatPrompt
from minisgl.limits import (
    MAX_DETOKENIZE_IDS,
    InvalidRequestError,
    check_prompt_size,
    check_token_ids,
)


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # prompt only: the template writes a chat's own
    return_token_strs: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: JsonObject | None = None


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: FailFastList[int] = Field(max_length=MAX_DETOKENIZE_IDS)


router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JsonObject:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt", "give either prompt or messages")
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    if body.prompt is not None:
        check_prompt_size([body.prompt], 0, ctx.limits, "prompt")
        ids = await ctx.on_tokenizer_thread(
            lambda: ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        )
    else:
        # Any tool choice but "none" renders the tools; "required" needs no --tool-call-parser.
        chat = ChatPrompt(
            body.messages,
            body.tools,
            None if body.tools is None else "required",
            template_kwargs=body.chat_template_kwargs,
        )
        run = Run(request, ApiRequest(chat, {}, {}))
        await run.tokenize()
        ids = run.prompts[0]
    token_strs = None
    if body.return_token_strs:  # a million of them take seconds: not on the event loop
        token_strs = await ctx.on_tokenizer_thread(lambda: [ctx.token_text(i) for i in ids])
    return {
        "count": len(ids),
        "max_model_len": ctx.limits.max_seq_len,
        "tokens": ids,
        "token_strs": token_strs,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> JsonObject:
    body = await DetokenizeRequest.from_request(request)
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    check_token_ids(body.tokens, ctx.limits, "tokens")
    return {"prompt": cast(str, await ctx.on_tokenizer_thread(ctx.tokenizer.decode, body.tokens))}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JsonObject:
    ctx: ServingContext = request.app.state.ctx
    tok = ctx.tokenizer
    special = {name: getattr(tok, name) for name in ("bos_token", "eos_token", "pad_token")}
    return {
        "tokenizer_class": type(tok).__name__,
        "chat_template": ctx.chat.chat_template or getattr(tok, "chat_template", None),
        **special,
    }
