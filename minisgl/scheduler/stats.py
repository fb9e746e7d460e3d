"""The scheduler's numbers for /metrics and tests: counters, per-step histograms, throughput.

Everything here is plain Python (no torch): the API server imports the bucket bounds to label
the histograms it exports, and the scheduler process fills them in.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

# Histogram bucket upper bounds (Prometheus `le`); values above the last go to +Inf.
# Queue time: from arrival at the scheduler to first admission, a fast GPU step to a long backlog.
QUEUE_TIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Requests in one forward step (decodes plus prefill chunks).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Tokens computed in one forward step (one per decode plus each prefill chunk's length).
BATCH_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Generation throughput is averaged over this much recent time, as SGLang's log interval does.
GEN_THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observation counts per bucket (not cumulative; one more than the bounds: +Inf) and sum."""

    bucket_counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)


@dataclass
class HistogramCounts:
    """A histogram the scheduler fills in; cheap enough to observe every step."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(tuple(self.counts), self.total)


@dataclass
class SchedulerHistograms:
    queue_time_s: HistogramCounts = field(
        default_factory=lambda: HistogramCounts(QUEUE_TIME_BUCKETS_S)
    )
    batch_size: HistogramCounts = field(default_factory=lambda: HistogramCounts(BATCH_SIZE_BUCKETS))
    batch_tokens: HistogramCounts = field(
        default_factory=lambda: HistogramCounts(BATCH_TOKENS_BUCKETS)
    )

    def observe_step(self, num_reqs: int, num_tokens: int) -> None:
        self.batch_size.observe(num_reqs)
        self.batch_tokens.observe(num_tokens)


def _empty(bounds: tuple[float, ...]) -> HistogramSnapshot:
    return HistogramCounts(bounds).snapshot()


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for /metrics and tests. Counters are totals since start."""

    num_running_reqs: int
    num_queue_reqs: int
    kv_cache_usage_ratio: float  # pages held by live requests (and their locked prefixes) / all
    num_free_pages: int  # free list plus evictable cache
    num_total_pages: int
    prompt_tokens_total: int  # prompt tokens looked up in the prefix cache (first admission)
    generation_tokens_total: int
    cached_prompt_tokens_total: int  # of those, tokens found in the cache
    prefill_tokens_total: int  # prompt tokens actually computed (cache hits excluded)
    num_retractions_total: int
    aborted_requests_total: int
    queue_time_s: HistogramSnapshot = field(default_factory=lambda: _empty(QUEUE_TIME_BUCKETS_S))
    batch_size: HistogramSnapshot = field(default_factory=lambda: _empty(BATCH_SIZE_BUCKETS))
    batch_tokens: HistogramSnapshot = field(default_factory=lambda: _empty(BATCH_TOKENS_BUCKETS))


class ThroughputWindow:
    """Tokens per second over the last `window_s`, from samples of a running total."""

    def __init__(self, window_s: float = GEN_THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now_s: float, total: int) -> float:
        self._samples.append((now_s, total))
        # Keep one sample at or before the window start, so the rate spans the whole window.
        while len(self._samples) > 2 and self._samples[1][0] <= now_s - self.window_s:
            self._samples.popleft()
        first_s, first_total = self._samples[0]
        elapsed_s = now_s - first_s
        return (total - first_total) / elapsed_s if elapsed_s > 0 else 0.0
