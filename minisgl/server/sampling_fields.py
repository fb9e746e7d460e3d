"""From a request body's sampling fields to `SamplingParams`, and back to what the response
reports about sampling (vLLM's `stop_reason`). Shared by every generation endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl.core import Constraint, SamplingParams, logit_bias_pairs
from minisgl.server.protocol import SamplingFields

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def build_sampling_params(
    body: SamplingFields,
    max_tokens: int,
    choice_index: int,
    constraint: Constraint | None = None,
    defaults: Mapping[str, float | int] | None = None,
) -> SamplingParams:
    """Raises InvalidRequestError (SamplingParams' own rules) for a bad field. `defaults` fill
    the sampling fields the request leaves unset (the model's recommended values)."""
    defaults = defaults or {}
    overrides: dict[str, Any] = {
        name: getattr(body, name) if getattr(body, name) is not None else defaults.get(name)
        for name in SAMPLING_FIELDS
    }
    # With a seed, choice i uses seed + i: n sequences that are reproducible yet differ.
    seed = None if body.seed is None else body.seed + choice_index
    return SamplingParams(
        max_tokens=max_tokens,
        seed=seed,
        stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logit_bias=logit_bias_pairs(body.logit_bias or {}),  # ids arrive as JSON keys (text)
        ignore_eos=body.ignore_eos,
        min_tokens=_min_tokens(body, max_tokens),
        logprobs=body.num_logprobs,
        prompt_logprobs=body.num_prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        constraint=constraint,
        **{name: value for name, value in overrides.items() if value is not None},
    )


def stop_reason(body: SamplingFields, matched: int | str | None) -> int | str | None:
    """vLLM's `stop_reason` of a choice: the stop string or the `stop_token_ids` entry that
    ended it; null for EOS, length and the rest."""
    if isinstance(matched, int) and matched not in (body.stop_token_ids or ()):
        return None  # EOS
    return matched


def _min_tokens(body: SamplingFields, max_tokens: int) -> int:
    """min_tokens as asked; capped by max_tokens only when the client left that to the context
    (asking for more than an explicit max_tokens is a 400, as in vLLM)."""
    if body.min_tokens is None:
        return 0
    return (
        body.min_tokens
        if body.requested_max_tokens is not None
        else min(body.min_tokens, max_tokens)
    )
