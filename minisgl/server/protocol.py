"""OpenAI-compatible request bodies (pydantic) and the shapes of responses and errors.

Unknown fields are ignored (`extra="ignore"`), as vLLM and SGLang do, so clients that send
OpenAI-only options never get a 422/400 for them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Upper bounds that keep one request from asking for absurd amounts of work.
MAX_CHOICES_PER_REQUEST = 128
MAX_TOP_LOGPROBS = 20


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by chat and text completions. None means "the default"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=MAX_CHOICES_PER_REQUEST)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    # Content checks (roles, text parts) happen in minisgl.tokenizer.chat with clear messages.
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the scheduler; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# ---------------------------------------------------------------------------------------------
# Responses are plain dicts: they are built per token on the streaming path, where pydantic
# models would only add cost. These helpers fix their shape in one place.


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_dict(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: Any = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
