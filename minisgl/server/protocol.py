"""OpenAI-compatible request bodies (pydantic) and the shapes of responses and errors.

The request models are where the HTTP side of validation lives: strict JSON types (no "3" or
true for an integer, no NaN or Infinity), text that is valid Unicode everywhere in the body, and
the bounds that are purely about the API (n). The value rules of sampling fields live in
`SamplingParams` and the model-dependent ones in `minisgl.limits`; `wire_param` maps the field
names those report back to the names this endpoint's clients sent. A new field only needs a
typed attribute here and, if it has value rules, a check in `SamplingParams`.

Unknown fields are ignored (`extra="ignore"`), as vLLM and SGLang do, so clients that send
OpenAI-only options never get a 422/400 for them. An explicit `null` means "the default" for
every field (OpenAI marks them nullable), so clients that send each field, unset ones as null,
get what omitting them gives.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minisgl.core import InvalidRequestError

# OpenAI's bound on choices per request.
MAX_CHOICES_PER_REQUEST = 128
# /v1/completions without max_tokens: OpenAI's default (and vLLM's and SGLang's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
CONSTRAINT_FIELDS = (
    "response_format",
    "regex",
    "ebnf",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "structured_outputs",
)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def find_invalid_text(data: Any) -> str | None:
    """The top-level field of a JSON value holding a string that is not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON escapes allow): such text cannot be encoded for
    the tokenizer or the other processes. "body" when it is not under a field; None if clean.
    Iterative, so any nesting depth costs no recursion."""
    stack: list[tuple[str, Any]] = [("body", data)]
    if isinstance(data, dict):
        stack = [(str(key), value) for key, value in data.items()]
        stack += [("body", key) for key in data]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(value, dict):
            stack.extend((where, key) for key in value)
            stack.extend((where, item) for item in value.values())
        elif isinstance(value, list):
            stack.extend((where, item) for item in value)
    return None


class OpenAIRequest(OpenAIBaseModel):
    """A request body: its text is checked for valid Unicode before any field is validated."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_valid_unicode(cls, data: Any) -> Any:
        where = find_invalid_text(data)
        if where is not None:
            raise InvalidRequestError(where, "must be valid Unicode text (no lone surrogates)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for a field is left out, so the field takes its default."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    def wire_param(self, name: str) -> str:
        """The request field that a rule reporting `name` (a SamplingParams field) is about."""
        return name


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingFields(OpenAIRequest):
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
    logit_bias: dict[str, Any] | None = None  # token id (as text) -> bias in [-100, 100]
    min_tokens: int | None = None  # vLLM: no EOS, stop token or stop string before this many
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM: the stop string stays in the text
    n: int = Field(default=1, ge=1, le=MAX_CHOICES_PER_REQUEST)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs (minisgl.chat.requests): at most one of these per request.
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    json_schema: str | dict[str, Any] | None = None  # SGLang: a JSON schema (text or object)
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: {json|regex|grammar|choice}

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
        return self

    @property
    def constraint_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the scheduler; None when logprobs are off."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token (SamplingParams.prompt_logprobs); None: off."""
        return None


class ChatCompletionRequest(SamplingFields):
    # Content checks (roles, text parts) happen in minisgl.tokenizer.chat with clear messages.
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Checked with clear messages in minisgl.chat.requests.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang: false keeps the reasoning inside the content
    # OpenAI's: reaches the template as `reasoning_effort` (as in vLLM); "none" also turns a
    # hybrid model's thinking off (Qwen3's enable_thinking=false) unless the request sets it.
    reasoning_effort: str | None = None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with what reasoning_effort implies."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        if self.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wire_param(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if name == "logprobs":
            return "top_logprobs"
        return name


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    # Not supported; refused rather than ignored, so a client learns its request was not run
    # as written (vLLM refuses suffix too). best_of equal to n is plain sampling.
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", "is not supported (other than equal to n)")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI: the first token's is null). echo
        with max_tokens 0 only echoes; it goes through the same prompt-only path."""
        if not self.echo:
            return None
        if self.logprobs is None and self.max_tokens != 0:
            return None
        return self.logprobs or 0


# ---------------------------------------------------------------------------------------------
# Responses are plain dicts: they are built per token on the streaming path, where pydantic
# models would only add cost. These helpers fix their shape in one place.


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's Responses and Anthropic's shape: `resp_...`, `msg_...`, `toolu_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """reasoning_tokens: part of completion_tokens (chat); None leaves the details out."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def error_dict(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: Any = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
