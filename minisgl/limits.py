"""Every bound on what a request may ask, in one table, and the rules that need the model.

Everything the table bounds reads it here; docs/server.md#limits lists it (tests/test_limits.py
keeps the two equal). The rules below it (vocabulary, context length, KV pool) run in the
server, for a 400 naming the field, and again in `Scheduler.add_request`, for the offline `LLM`
(docs/architecture.md#one-requests-life, steps 1 and 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.core import SamplingParams

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# ---- The table -----------------------------------------------------------------------------
# What the engine can represent: token ids and lengths live in int32 tables; seeds and other
# integers travel as int64.
INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKEN_ID = INT32_MAX
# Sampling fields (SamplingParams)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias, either sign
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_USER_CHARS = 256  # `user`: a metric label and a key of the scheduler's counters
# Structured outputs: a grammar's source text, what one compile may take
MAX_CONSTRAINT_CHARS = 1 << 20
# The UTF-8 size of a schema / regex / grammar / tool-call tag compiled; real ones are a few KB.
MAX_CONSTRAINT_BYTES = 256 * KIB
# A compile taking the grammar worker (idle at ~0.4 GB) past this is refused: fixed, not a share
# of the machine, so that it does not grow with a big host.
MAX_WORKER_RSS_BYTES = 2 * GIB
# Grammars of one client (tenant) compiling or queued to compile at once: a 400 past it.
MAX_COMPILES_PER_CLIENT = 32
MAX_TOOLS = 128
# JSON from clients (minisgl.chat.jsontext): deeper than any schema or message list needs, far
# below where recursive code runs out of stack; each object costs microseconds to validate
# (Anthropic's API allows 100,000 messages).
MAX_JSON_DEPTH = 128
MAX_JSON_OBJECTS = 100_000
# Array elements and object members, numbers included: what a body costs to parse and validate
# grows with them, whatever they are. Twice the longest /detokenize.
MAX_JSON_ITEMS = 1 << 21
# Dialects
MAX_CHOICES_PER_REQUEST = 128  # `n` (OpenAI's bound)
MAX_DETOKENIZE_IDS = 1 << 20  # /detokenize
MAX_LISTED_ITEMS = 100  # GET /v1/responses/{id}/input_items?limit=
DEFAULT_MAX_TOKENS = 16  # SamplingParams, /v1/completions (vLLM's and OpenAI's default)
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SGLang's /generate without max_new_tokens
# The server's flags' defaults (minisgl.config)
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n
DEFAULT_MAX_QUEUED_REQUESTS = 1024  # sequences waiting beyond --max-running-requests
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * MIB
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
# A client that stops sending holds a descriptor and a task: its request line and headers must
# arrive whole within CLIENT_TIMEOUT_S (KEEP_ALIVE_S after a response), its body may pause no
# longer (nginx's client_header_timeout and client_body_timeout; 408 for a body).
CLIENT_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 30
# The Responses API's store of past responses (previous_response_id)
MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * MIB
# ---------------------------------------------------------------------------------------------


class InvalidRequestError(ValueError):
    """A request that cannot run, with the field to blame. Its text is "param: message", and the
    server turns it into an error reply of `status` (400, or 429 for a client over its share)
    whose `param` names the field."""

    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
        self.status = status


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int  # context length, in tokens
    vocab_size: int
    kv_capacity_tokens: int  # every KV page of the pool, in tokens: the most one sequence can hold
    # The vocabulary's longest token, in characters: a prompt longer than max_model_len of them
    # cannot fit whatever it says. 0: unknown (no such check).
    max_token_chars: int = 0

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + output) that can run: the smaller of the two limits."""
        return min(self.max_model_len, self.kv_capacity_tokens)


def _too_long_message(limits: ModelLimits, prompt_len: int, max_tokens: int | None) -> str:
    """Names the limit that is exceeded: the context length first, as users know it."""
    total_len = prompt_len + (max_tokens if max_tokens is not None else 1)
    if total_len > limits.max_model_len:
        what, limit = "context length", limits.max_model_len
    else:
        what, limit = "KV cache capacity", limits.kv_capacity_tokens
    if max_tokens is None:
        return (
            f"This model's maximum {what} is {limit} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for the completion."
        )
    return (
        f"This model's maximum {what} is {limit} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the prompt or max_tokens."
    )


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    limits: ModelLimits,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """vLLM's rule: without max_tokens, generate up to what the context (and the KV pool) leaves.
    Raises InvalidRequestError naming the prompt when it alone fills the context, else the
    max_tokens field (`max_tokens_param`: e.g. max_completion_tokens) when the sum does not fit.
    Whether `requested` itself is a valid value is SamplingParams' rule. 0 (score the prompt,
    generate nothing) needs room for the prompt only."""
    if requested == 0 and prompt_len <= limits.max_seq_len:
        return 0
    if prompt_len >= limits.max_seq_len:
        raise InvalidRequestError(prompt_param, _too_long_message(limits, prompt_len, requested))
    if requested is None:
        return limits.max_seq_len - prompt_len
    if prompt_len + requested > limits.max_seq_len:
        message = _too_long_message(limits, prompt_len, requested)
        raise InvalidRequestError(max_tokens_param, message)
    return requested


def check_prompt_size(
    texts: Sequence[str], num_messages: int, limits: ModelLimits, param: str
) -> None:
    """Before any tokenizing or templating: refuse a prompt certainly past the context, in
    microseconds where encoding it would take seconds. Every token is at most max_token_chars
    characters long, and a chat template renders each message as at least one token."""
    num_chars = sum(map(len, texts))
    if limits.max_token_chars and num_chars > limits.max_model_len * limits.max_token_chars:
        counted = f"its {num_chars} characters are more tokens than that"
    elif num_messages > limits.max_model_len:
        counted = f"its {num_messages} messages are more tokens than that"
    else:
        return
    message = f"This model's maximum context length is {limits.max_model_len} tokens: {counted}."
    raise InvalidRequestError(param, message)


def check_token_ids(ids: Sequence[int], limits: ModelLimits, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        message = f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
        raise InvalidRequestError(param, message)


def check_request(
    input_ids: Sequence[int],
    params: SamplingParams,
    limits: ModelLimits,
    prompt_param: str = "prompt",
) -> None:
    """Raise InvalidRequestError for a request that could never run on this model. The length
    first: each id's check costs time, which only a prompt that fits is worth."""
    if not input_ids:
        raise InvalidRequestError(prompt_param, "must not be empty")
    resolve_max_tokens(params.max_tokens, len(input_ids), limits, prompt_param)
    check_token_ids(input_ids, limits, prompt_param)
    check_token_ids([t for t, _ in params.logit_bias], limits, "logit_bias")
    if params.top_k > limits.vocab_size:
        raise InvalidRequestError(
            "top_k", f"must be at most the vocabulary size ({limits.vocab_size}), or -1/0 for off"
        )
