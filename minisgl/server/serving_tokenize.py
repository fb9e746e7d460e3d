"""POST /tokenize and /detokenize, as vLLM (and SGLang) serve them.

/tokenize takes a `prompt` (tokenized as /v1/completions does it) or chat `messages` (with
`tools` and `chat_template_kwargs`: rendered as /v1/chat/completions does it, ready for the
reply), so a client counts exactly the tokens a request would cost. /detokenize turns ids back
into text.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import Field, model_validator

from minisgl.chat import prepare_chat
from minisgl.core import InvalidRequestError
from minisgl.server.errors import HTTP_BAD_REQUEST, RequestError
from minisgl.server.generation import ServingContext
from minisgl.server.protocol import OpenAIRequest

# The most ids one /detokenize takes (a whole context of the largest models, with room).
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # prompt only: the template writes a chat's own
    return_token_strs: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give either prompt or messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def _ids(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    """On the tokenizer thread."""
    if body.prompt is not None:
        encoded = ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
        return [int(t) for t in encoded["input_ids"]]
    prepared = prepare_chat(
        ctx.tokenizer,
        ctx.chat,
        body.messages,
        tools=body.tools,
        # Any choice but "none" renders the tools; "required" needs no --tool-call-parser.
        tool_choice=None if body.tools is None else "required",
        template_kwargs=body.chat_template_kwargs,
    )
    return prepared.prompt_ids


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict[str, Any]:
    ctx.check_model(body.model)
    try:
        ids = await ctx.off_loop(_ids, ctx, body)
    except InvalidRequestError as exc:
        raise RequestError(HTTP_BAD_REQUEST, str(exc), param=exc.param) from None
    except ValueError as exc:  # about the messages
        raise RequestError(HTTP_BAD_REQUEST, str(exc), param="messages") from None
    return {
        "count": len(ids),
        "max_model_len": ctx.limits.max_seq_len,
        "tokens": ids,
        "token_strs": [ctx.token_text(i) for i in ids] if body.return_token_strs else None,
    }


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict[str, Any]:
    ctx.check_model(body.model)
    vocab_size = ctx.limits.vocab_size
    bad = next((i for i in body.tokens if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise RequestError(
            HTTP_BAD_REQUEST,
            f"tokens: {bad} is not a token id of this model (0 <= id < {vocab_size})",
            param="tokens",
        )
    text = await ctx.off_loop(ctx.tokenizer.decode, body.tokens)
    return {"prompt": cast(str, text)}
