"""The shared vocabulary: sampling parameters, requests and their results. Every layer (offline
API, scheduler, server) speaks in these types; invariants are checked where objects are built,
so a bad value fails at the edge with a message naming the field."""

from __future__ import annotations

import enum
import functools
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minisgl.limits import (
    DEFAULT_MAX_TOKENS,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_CONSTRAINT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_USER_CHARS,
    InvalidRequestError,
)
from minisgl.pooling import Pooling

if TYPE_CHECKING:
    from minisgl.grammar import GrammarState
    from minisgl.scheduler.speculative import NgramDrafter

# Seeds are folded into 31 bits: the sampler's counter-based hash works on 32-bit lanes.
SEED_MASK = (1 << 31) - 1
KEY_TENANT_PREFIX = "key-"  # the tenant of a request that names no user but presents an API key
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled by the client or at shutdown
    ERROR = "error"  # rejected: the message says why


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _is_int(value: Any, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    """An integer (not a bool) in [low, high]: by default, one that travels as int64."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _in_range(value: Any, low: float, high: float) -> bool:
    """A finite number in [low, high] (NaN and infinities fail every comparison here)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and low <= value <= high


@dataclass(frozen=True)
class Constraint:
    """Grammar-constrained decoding: every sampled token keeps the output a prefix of a string
    the grammar accepts (minisgl.grammar compiles it; the sampler masks the logits)."""

    # "json_schema" (value: the schema as JSON text), "json_object" (any JSON object; value
    # unused), "regex", "ebnf" (GBNF, rule `root`) or "structural_tag" (xgrammar's, as JSON text:
    # tool calls in free text)
    kind: str
    value: str = ""
    # token ids that must end the output before the grammar applies (a reasoning model's
    # `</think>`); empty: from the first token
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(
            self.kind in CONSTRAINT_KINDS, "constraint", f"kind must be one of {CONSTRAINT_KINDS}"
        )
        _check(
            isinstance(self.value, str) and len(self.value) <= MAX_CONSTRAINT_CHARS,
            "constraint",
            f"must be text of at most {MAX_CONSTRAINT_CHARS} characters",
        )
        object.__setattr__(self, "start_after", tuple(self.start_after))
        _check(
            all(_is_int(t, 0, MAX_TOKEN_ID) for t in self.start_after),
            "constraint",
            "start_after must be token ids",
        )

    @property
    def grammar_key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (start_after only gates when it applies)."""
        return (self.kind, self.value)


def logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs; InvalidRequestError for anything else."""
    not_a_map = "must map token ids to biases"
    _check(isinstance(bias, (dict, tuple, list)), "logit_bias", not_a_map)
    pairs = []
    for entry in bias.items() if isinstance(bias, dict) else bias:
        _check(isinstance(entry, (tuple, list)) and len(entry) == 2, "logit_bias", not_a_map)
        key, value = entry
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12
        token_id = int(key) if digits else key  # int() of thousands of digits raises
        _check(
            _is_int(token_id, 0, MAX_TOKEN_ID),
            "logit_bias",
            f"keys must be token ids (integers in [0, {MAX_TOKEN_ID}]), got {str(key)[:24]!r}",
        )
        _check(
            _in_range(value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
            "logit_bias",
            f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}",
        )
        pairs.append((token_id, float(value)))
    _check(
        len(pairs) <= MAX_LOGIT_BIAS_ENTRIES,
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS_ENTRIES} entries",
    )
    _check(len({t for t, _ in pairs}) == len(pairs), "logit_bias", "a token id appears twice")
    return tuple(sorted(pairs))


def _logprobs_count(value: Any) -> bool:
    return value is None or _is_int(value, 0, MAX_LOGPROBS)


# The rules of SamplingParams' fields that need nothing but the field itself, checked in order.
_FIELD_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("temperature", lambda v: _in_range(v, 0, math.inf), "must be a finite number >= 0"),
    ("top_p", lambda v: _in_range(v, 0, 1) and v > 0, "must be in (0, 1]"),
    (
        "top_k",
        lambda v: _is_int(v, -1, INT32_MAX),
        "must be -1 or 0 (off) or a positive integer (at most the vocabulary size)",
    ),
    ("min_p", lambda v: _in_range(v, 0, 1), "must be in [0, 1]"),
    (
        "repetition_penalty",
        lambda v: _in_range(v, 0, math.inf) and v > 0,
        "must be a finite number > 0",
    ),
    ("presence_penalty", lambda v: _in_range(v, -2, 2), "must be in [-2, 2]"),
    ("frequency_penalty", lambda v: _in_range(v, -2, 2), "must be in [-2, 2]"),
    ("seed", lambda v: v is None or _is_int(v), "must be a 64-bit signed integer"),
    ("priority", _is_int, "must be a 64-bit signed integer"),
    (
        "user",
        lambda v: v is None or (isinstance(v, str) and len(v) <= MAX_USER_CHARS),
        f"must be text of at most {MAX_USER_CHARS} characters",
    ),
    *(
        (name, lambda v: isinstance(v, bool), "must be a boolean")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
    ),
    ("logprobs", _logprobs_count, f"must be in [0, {MAX_LOGPROBS}]"),
    ("constraint", lambda v: v is None or isinstance(v, Constraint), "must be a Constraint"),
    ("pooling", lambda v: v is None or isinstance(v, Pooling), "must be a Pooling"),
    # stop and stop_token_ids: tuples by now (SamplingParams.__post_init__)
    ("stop", lambda v: len(v) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} strings"),
    (
        "stop",
        lambda v: all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in v),
        f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
    ),
    ("stop_token_ids", lambda v: len(v) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} ids"),
    (
        "stop_token_ids",
        lambda v: all(_is_int(t, 0, MAX_TOKEN_ID) for t in v),
        f"must be token ids in [0, {MAX_TOKEN_ID}]",
    ),
)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Defaults follow vLLM / OpenAI."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    # Until this many tokens are out, EOS and stop_token_ids are never drawn and stop strings
    # do not match (vLLM's min_tokens, SGLang's min_new_tokens)
    min_tokens: int = 0
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
    # Keep the stop string that ended the text in it (vLLM's include_stop_str_in_output,
    # SGLang's no_stop_trim); by default it is cut off.
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None  # structured output (JSON schema, regex, ...)
    # Added to the logits before sampling: (token id, bias) pairs; a dict {id: bias} (ids as
    # ints or, as JSON sends them, strings) is accepted and stored sorted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The prompt's own logprobs: for each prompt token after the first, its logprob given the
    # tokens before it plus the top k alternatives (None: off). The prompt is then computed in
    # full (no prefix-cache reuse); max_tokens may be 0 (score the prompt, generate nothing).
    prompt_logprobs: int | None = None
    # Scheduling, not sampling, but they travel the same way: larger `priority` goes sooner
    # (--enable-priority-scheduling); `user` names the tenant (--tenant-fairness).
    priority: int = 0
    user: str | None = None
    # An embedding request (max_tokens 0): the prompt's pooled final hidden state is its output.
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        """Every rule a request's sampling fields obey lives here; the server and `LLM` both
        rely on it. Rules that need the model (vocabulary, context) are in minisgl.limits."""
        # Accept the shapes users type (a single stop string, lists) and store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (list, tuple)) or not stop, "stop", "must be a string or a list")
        object.__setattr__(self, "stop", tuple(stop or ()))
        stop_ids = self.stop_token_ids or ()
        _check(isinstance(stop_ids, (list, tuple)), "stop_token_ids", "must be a list of ints")
        try:  # numpy / torch integer scalars are fine, floats and bools are not
            as_ints = tuple(operator.index(t) for t in stop_ids if not isinstance(t, bool))
        except TypeError:
            as_ints = ()
        _check(len(as_ints) == len(stop_ids), "stop_token_ids", "must be a list of ints")
        object.__setattr__(self, "stop_token_ids", as_ints)
        message = f"must be in [0, {MAX_LOGPROBS}]"
        _check(_logprobs_count(self.prompt_logprobs), "prompt_logprobs", message)
        # 0: only score the prompt, or embed it (then nothing more)
        min_tokens = 0 if self.prompt_logprobs is not None or self.pooling is not None else 1
        max_tokens = 0 if self.pooling is not None else INT32_MAX
        _check(
            _is_int(self.max_tokens, min_tokens, max_tokens),
            "max_tokens",
            f"must be an integer in [{min_tokens}, {max_tokens}]",
        )
        _check(
            _is_int(self.min_tokens, 0, self.max_tokens),
            "min_tokens",
            "must be an integer from 0 to max_tokens",
        )
        for name, allowed, message in _FIELD_RULES:
            _check(allowed(getattr(self, name)), name, message)
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

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

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs per-row sampling state (penalties, logit_bias,
        min_tokens bans, logprobs): the token is the argmax of the raw logits."""
        plain = not (self.has_penalties or self.logit_bias or self.min_tokens)
        return plain and self.is_greedy and self.logprobs is None


_rid_counter = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_rid_counter)}"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(eq=False, slots=True)
class Req:
    """One sequence inside the scheduler. Its lengths count tokens from position 0 of the
    sequence, and cached_len <= device_len always."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # len(input_ids), the client's tokens (outputs excluded, retracted or not); read several
    # times a step
    prompt_len: int = field(init=False)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # sampling_params.prompt_logprobs: prompt tokens 1.. scored so far (position 0 has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # scheduling state, owned by the scheduler
    table_row: int = -1
    cached_len: int = 0  # tokens whose KV is written in the pool (radix hits included)
    # tokens known on the device: the prompt and every sampled token, the one an in-flight batch
    # is producing included (overlap), so device_len - prompt_len are scheduled for sampling
    device_len: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission, for usage reporting
    seed: int = 0  # the request's sampling seed (drawn by the scheduler when the client gave none)
    # KV ownership, managed by the scheduler's cache manager
    page_ids: list[int] = field(default_factory=list)  # pages backing positions, in order
    cache_handle: object = None  # the prefix cache's (opaque) handle of the locked matched prefix
    cache_matched_len: int = 0  # tokens whose pages belong to the prefix cache, not this request
    # structured output: the compiled grammar as sent by the API server (serialized; None: the
    # scheduler compiles sampling_params.constraint itself), then the live matcher state
    grammar_json: str | None = None
    grammar: GrammarState | None = None
    # speculative decoding: the draft tokens this step verifies (after device_len), the drafter
    drafts: list[int] = field(default_factory=list)
    drafter: NgramDrafter | None = None
    num_retractions: int = 0
    pooled: Any = 0  # embedding requests: their chunks' pooled states summed (a tensor)
    finish_reason: FinishReason | None = None
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        # (an empty prompt is refused by minisgl.limits.check_request, in Scheduler.add_request)
        self.device_len = self.prompt_len = len(self.input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are wanted and not all computed yet."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def remaining_prefill_len(self) -> int:
        return self.device_len - self.cached_len


def finish_reason(
    params: SamplingParams,
    last: int | str,
    num_outputs: int,
    room_len: int = 1,
    eos_token_ids: tuple[int, ...] = (),
) -> FinishReason | None:
    """The one rule for when a request ends: STOP at a stop string, a stop token id or an EOS
    (unless ignore_eos), LENGTH at max_tokens or a full context, else None. The scheduler asks
    for every sampled token (`last`; `room_len`: positions left in the context), the detokenizer
    (server and offline `LLM`) for a stop string its text shows (`last`)."""
    eos = last in eos_token_ids and not params.ignore_eos
    if isinstance(last, str) or last in params.stop_token_ids or eos:
        return FinishReason.STOP
    if num_outputs >= params.max_tokens or room_len <= 0:
        return FinishReason.LENGTH
    return None


@dataclass(slots=True)  # not frozen, cheaper to build: one is made per running request per step
class ReqOutput:
    """A request's progress in a step: new tokens and maybe its end (the scheduler's), their text
    and a stop string that ended it (the detokenizer's), as the API server gets it."""

    rid: str
    token_ids: tuple[int, ...]  # new tokens whose text shows
    finish_reason: FinishReason | None = None
    # of token_ids, then of the final token that ended the output (matched_stop), if any
    logprobs: tuple[TokenLogprob, ...] = ()
    num_cached_prompt_tokens: int = 0
    # With the request's first output: prompt tokens 1.. scored (sampling_params.prompt_logprobs)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # What ended a STOP finish: the EOS or stop token id sampled last (generated, never shown),
    # or the stop string
    matched_stop: int | str | None = None
    text: str = ""  # the detokenizer's: new text, safe to show (no partial character)
    error: str | None = None
    internal_error: bool = False  # the error is the server's (a failed step), not the request's
    embedding: bytes | None = None  # with an embedding request's finish: float32, little-endian

    @property
    def num_new_tokens(self) -> int:
        """New tokens generated, a hidden final EOS or stop token included (for usage)."""
        return len(self.token_ids) + isinstance(self.matched_stop, int)
