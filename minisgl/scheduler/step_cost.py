"""What a step costs, learned from the steps run, and the prefill chunk that keeps a step with
decodes within the inter-token latency target (`--target-itl-ms`; docs/server.md, "Chunked
prefill").

A step that decodes costs a decode step (the average of recent decode-only steps) plus, for each
prefill chunk of n tokens after a prefix of p, `token_s * n + pair_s * pairs`, where
pairs = n * p + n * (n + 1) / 2 are the (query, key) pairs its attention computes: a token late
in a long prompt costs more than an early one. token_s and pair_s are a least-squares fit of
recent steps that decode and prefill, each older step weighing DECAY times less. Steps that only
prefill are left out: their chunks are bigger and cost less per token (a small chunk streams the
weights for a few rows), and one such step would outweigh dozens of small ones in the fit."""

import math
from dataclasses import dataclass

from minisgl.config import AUTO_ITL_DECODE_STEPS, AUTO_ITL_EXTRA_MS
from minisgl.engine.batch import ForwardBatch

DECAY = 0.9  # an observation's weight, per newer one: the fit follows the last ~10 steps
DECODE_STEP_WEIGHT = 0.2  # of a new decode-only step, in the decode step's moving average
# A step's first chunk has at least this many tokens, so that prefill moves on even when the
# decodes alone take the whole target; and this many while no prefill has been measured.
MIN_CHUNK_TOKENS = 16
# Below this share of their own norms the two columns of the fit are one: token_s alone.
MIN_FIT_INDEPENDENCE = 1e-3
NO_LIMIT = 1 << 62


def attention_pairs(num_tokens: int, prefix_len: int) -> float:
    """(query, key) pairs a chunk of `num_tokens` after `prefix_len` cached ones attends to."""
    return num_tokens * prefix_len + num_tokens * (num_tokens + 1) / 2


@dataclass(frozen=True)
class ChunkCosts:
    """What one step's chunk sizes are computed from (rank 0's, the same on every tp rank)."""

    budget_s: float = math.inf  # a step that decodes may spend this on prefill; inf: no limit
    token_s: float = 0.0  # per prompt token
    pair_s: float = 0.0  # per (query, key) pair of attention

    def cost_s(self, num_tokens: int, prefix_len: int) -> float:
        return self.token_s * num_tokens + self.pair_s * attention_pairs(num_tokens, prefix_len)

    def max_tokens(self, budget_s: float, prefix_len: int) -> int:
        """The most tokens a chunk after `prefix_len` may have to cost at most `budget_s`: the
        root of pair_s / 2 * n^2 + (token_s + pair_s * (prefix_len + 1/2)) * n = budget_s."""
        if budget_s == math.inf:
            return NO_LIMIT
        if budget_s <= 0:  # no time left
            return 0
        linear_s = self.token_s + self.pair_s * (prefix_len + 0.5)
        if linear_s <= 0:  # nothing measured yet
            return MIN_CHUNK_TOKENS
        # the root in the form that holds for pair_s = 0 too
        return int(2 * budget_s / (linear_s + math.sqrt(linear_s**2 + 2 * self.pair_s * budget_s)))


class StepCosts:
    """The running estimates: `observe` each batch when its results are in, `costs()` before
    scheduling one. target_itl_ms: None: auto; 0: off (no time limit)."""

    def __init__(self, target_itl_ms: float | None) -> None:
        self.target_itl_ms = target_itl_ms
        self.decode_step_s = 0.0  # 0 until a decode-only step was seen
        # Weighted sums of the fit: tokens^2, tokens*pairs, pairs^2, tokens*y, pairs*y (y: the
        # step's time less a decode step's).
        self.sums = [0.0] * 5
        self._last_done_s = 0.0

    def observe(self, batch: ForwardBatch, launched_s: float, done_s: float) -> None:
        """A batch launched at `launched_s`, its results in at `done_s`. Its time starts when
        the batch before it was done, if that was later (the overlap loop)."""
        step_s = done_s - max(launched_s, self._last_done_s)
        self._last_done_s = done_s
        seqs = [s for s in zip(batch.extend_lens, batch.prefix_lens, strict=True) if s[0] > 1]
        if not seqs:
            weight = DECODE_STEP_WEIGHT if self.decode_step_s else 1.0
            self.decode_step_s += weight * (step_s - self.decode_step_s)
            return
        if len(seqs) == len(batch.extend_lens):  # nothing decoded
            return
        x = sum(n for n, _ in seqs), sum(attention_pairs(n, p) for n, p in seqs)
        y = step_s - self.decode_step_s
        terms = (x[0] * x[0], x[0] * x[1], x[1] * x[1], x[0] * y, x[1] * y)
        self.sums = [DECAY * total + term for total, term in zip(self.sums, terms, strict=True)]

    def costs(self) -> ChunkCosts:
        """This step's: the prefill budget of a step that decodes, and the fitted costs."""
        target_ms = self.target_itl_ms
        if target_ms is None:
            target_ms = AUTO_ITL_DECODE_STEPS * self.decode_step_s * 1000 + AUTO_ITL_EXTRA_MS
        if not target_ms:
            return ChunkCosts()
        return ChunkCosts(target_ms / 1000 - self.decode_step_s, *fit(*self.sums))


def fit(tt: float, tp: float, pp: float, ty: float, py: float) -> tuple[float, float]:
    """(token_s, pair_s) minimising the weighted squared error, from the sums of tokens^2,
    tokens*pairs, pairs^2, tokens*y and pairs*y; token_s alone where the two columns are one
    or the pair fit gives one a negative cost."""
    det = tt * pp - tp * tp
    if det > MIN_FIT_INDEPENDENCE * tt * pp:
        token_s, pair_s = (ty * pp - py * tp) / det, (py * tt - ty * tp) / det
        if min(token_s, pair_s) >= 0:
            return token_s, pair_s
    return (max(0.0, ty / tt) if tt else 0.0), 0.0
