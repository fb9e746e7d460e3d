"""The request rules that need the model: vocabulary, context length and KV pool capacity.

Field-by-field rules live in `SamplingParams`; these are the rest. The server checks them before
a request reaches the scheduler (to answer 400 with the right `param`), and the scheduler checks
them again in `Scheduler.validate` (the offline `LLM` and any other sender): one function, two
callers, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.core import InvalidRequestError, SamplingParams


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
    """Raise InvalidRequestError for a request that could never run on this model."""
    if not input_ids:
        raise InvalidRequestError(prompt_param, "must not be empty")
    check_token_ids(input_ids, limits, prompt_param)
    check_token_ids([t for t, _ in params.logit_bias], limits, "logit_bias")
    if params.top_k > limits.vocab_size:
        raise InvalidRequestError(
            "top_k", f"must be at most the vocabulary size ({limits.vocab_size}), or -1/0 for off"
        )
    resolve_max_tokens(params.max_tokens, len(input_ids), limits, prompt_param)
