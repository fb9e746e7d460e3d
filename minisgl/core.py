"""The shared vocabulary: sampling parameters, requests and their results.

Every layer of minisgl (offline API, scheduler, server) speaks in these types. Invariants are
checked where objects are built, so a bad value fails at the edge with a message naming the field.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

# Seeds are folded into 31 bits: the sampler's counter-based hash works on 32-bit lanes.
SEED_MASK = (1 << 31) - 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled by the client or at shutdown
    ERROR = "error"  # rejected: the message says why


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Defaults follow vLLM / OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token plus the top k alternatives
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept the shapes users type (a single stop string, lists) and store tuples.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be >= 1"
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be a finite number >= 0",
        )
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off) or >= 0")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


_rid_counter = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_rid_counter)}"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(eq=False)
class Req:
    """One sequence inside the scheduler.

    Lengths, all in tokens and all counted from position 0 of the sequence:
      prompt_len     tokens given by the client (after retraction: the original prompt)
      cached_len     tokens whose KV is written in the pool (radix hits included)
      device_len     tokens known on the device: prompt + every sampled token, including the one
                     an in-flight batch is producing right now (overlap scheduling)
    Invariant: cached_len <= device_len.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # scheduling state, owned by the scheduler
    table_row: int = -1
    cached_len: int = 0
    device_len: int = 0
    num_sampled: int = 0  # tokens scheduled for sampling, in-flight included
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission, for usage reporting
    seed: int = 0  # the request's sampling seed (drawn by the scheduler when the client gave none)
    # KV ownership, managed by the scheduler's cache manager
    page_ids: list[int] = field(default_factory=list)  # pages backing positions, in order
    cache_handle: Any = None  # locked prefix-cache node of the matched prefix
    cache_matched_len: int = 0  # tokens whose pages belong to the prefix cache, not this request
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        _check(len(self.input_ids) > 0, "prompt", "must not be empty")
        self.device_len = len(self.input_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_prefill_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def max_total_len(self) -> int:
        """The longest this sequence can become: prompt plus max_tokens."""
        return self.prompt_len + self.sampling_params.max_tokens


@dataclass(frozen=True)
class ReqOutput:
    """What the scheduler reports for one request after a step: new tokens, maybe the end."""

    rid: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    new_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_len: int = 0
    num_cached_prompt_tokens: int = 0
    error: str | None = None
