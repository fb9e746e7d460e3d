"""The scheduler's counters, per-step histograms and throughput window: what it reports as
`SchedulerStats` (minisgl.stats, where each number's meaning and metric name live)."""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minisgl.core import KEY_TENANT_PREFIX
from minisgl.scheduler.policy import tenant_of
from minisgl.stats import (
    BATCH_SIZE_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    GEN_THROUGHPUT_WINDOW_S,
    MAX_LABEL_VALUES,
    OTHER_LABEL,
    QUEUE_TIME_BUCKETS_S,
    HistogramSnapshot,
)

if TYPE_CHECKING:
    from minisgl.core import Req

MAX_LABEL_CHARS = 64
# A label value's traffic: each observation adds 1 (an API key's KEY_LABEL_WEIGHT: it takes a slot
# before any `user` value) and every count decays by LABEL_DECAY; a value takes the slot of the
# one with the least traffic once it has LABEL_TAKEOVER_RATIO times as much. Values whose traffic
# falls to MIN_LABEL_TRAFFIC are forgotten (so at most a few hundred are tracked).
LABEL_DECAY = 0.99
KEY_LABEL_WEIGHT = 8.0
LABEL_TAKEOVER_RATIO = 2.0
MIN_LABEL_TRAFFIC = 0.01


class HistogramCounts:
    """A histogram the scheduler fills in; cheap enough to observe every step."""

    def __init__(self, bounds: tuple[float, ...] = QUEUE_TIME_BUCKETS_S) -> None:
        self.bounds, self.counts = bounds, [0] * (len(bounds) + 1)
        self.sum = 0.0  # of the observed values

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(tuple(self.counts), self.sum)


def _histogram_counts(bounds: tuple[float, ...]) -> Any:
    return field(default_factory=lambda: HistogramCounts(bounds))


class LabelSlots:
    """A histogram per label value, at most MAX_LABEL_VALUES of them and OTHER_LABEL's for the
    rest: the values with the most recent traffic (the constants above), so values that stop
    sending (a burst of junk `user`s) hold no slot for good. A value is shown printable and at
    most MAX_LABEL_CHARS long; one with nothing printable is OTHER_LABEL's."""

    def __init__(self) -> None:
        self.series = {OTHER_LABEL: HistogramCounts()}
        # The labelled values' traffic and recent others' (OTHER_LABEL's: never the weakest).
        self._traffic = {OTHER_LABEL: math.inf}

    def observe(self, value: str, observed: float) -> None:
        label = "".join(filter(str.isprintable, value))[:MAX_LABEL_CHARS] or OTHER_LABEL
        series, traffic = self.series, self._traffic
        traffic = {
            k: t * LABEL_DECAY for k, t in traffic.items() if t > MIN_LABEL_TRAFFIC or k in series
        }
        weight = KEY_LABEL_WEIGHT if label.startswith(KEY_TENANT_PREFIX) else 1.0
        traffic[label] = traffic.get(label, 0.0) + weight
        self._traffic = traffic
        if label not in series:
            weakest = min(series, key=traffic.__getitem__)
            if (
                len(series) > MAX_LABEL_VALUES
                and traffic[label] > LABEL_TAKEOVER_RATIO * traffic[weakest]
            ):
                del series[weakest]
            if len(series) <= MAX_LABEL_VALUES:
                series[label] = HistogramCounts()
        series.get(label, series[OTHER_LABEL]).observe(observed)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {label: h.snapshot() for label, h in self.series.items() if any(h.counts)}


@dataclass
class SchedulerCounters:
    """The scheduler's counters (totals since start) and per-step histograms: what `stats()`
    reports, under the names of their `SchedulerStats` fields."""

    prompt_tokens_total: int = 0  # prompt tokens looked up in the prefix cache (first admission)
    cached_prompt_tokens_total: int = 0  # of those, tokens found in the cache
    prefill_tokens_total: int = 0  # prompt tokens actually computed (cache hits excluded)
    generation_tokens_total: int = 0
    embedding_requests_total: int = 0
    embedding_prompt_tokens_total: int = 0
    # speculative decoding: verify steps (a request's drafts checked once), drafts, accepted ones
    spec_verify_steps_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    queue_time_s: HistogramCounts = _histogram_counts(QUEUE_TIME_BUCKETS_S)
    batch_size: HistogramCounts = _histogram_counts(BATCH_SIZE_BUCKETS)
    batch_tokens: HistogramCounts = _histogram_counts(BATCH_TOKENS_BUCKETS)
    queue_time_by_priority_s: LabelSlots = field(default_factory=LabelSlots)
    queue_time_by_tenant_s: LabelSlots = field(default_factory=LabelSlots)

    def first_admission(self, req: Req) -> None:
        """A request admitted for the first time (not after a retraction), its prefix matched."""
        self.prompt_tokens_total += req.prompt_len
        self.cached_prompt_tokens_total += req.cached_len
        if req.sampling_params.pooling is not None:
            self.embedding_requests_total += 1
            self.embedding_prompt_tokens_total += req.prompt_len
        if req.arrival_time > 0:  # set by the server; offline requests have none
            queue_time_s = time.monotonic() - req.arrival_time
            self.queue_time_s.observe(queue_time_s)
            self.queue_time_by_priority_s.observe(str(req.sampling_params.priority), queue_time_s)
            self.queue_time_by_tenant_s.observe(tenant_of(req), queue_time_s)

    def step(self, num_decodes: int, chunks: list[tuple[Req, int]], num_drafts: int = 0) -> None:
        """A step's batch: decodes (a token each, and `num_drafts` draft tokens between them)
        and prefill (request, tokens to compute) chunks, before they advance the requests."""
        chunk_tokens = sum(num_tokens for _, num_tokens in chunks)
        self.batch_size.observe(num_decodes + len(chunks))
        self.batch_tokens.observe(num_decodes + num_drafts + chunk_tokens)
        # the prompt tokens among them (cache hits never get here; a retracted request's chunk
        # may recompute output tokens too)
        self.prefill_tokens_total += sum(
            max(0, min(r.prompt_len - r.cached_len, n)) for r, n in chunks
        )

    def snapshot(self) -> dict[str, Any]:
        """SchedulerStats fields: the totals, and a snapshot of each histogram."""

        def snap(v: Any) -> Any:
            return v.snapshot() if isinstance(v, (HistogramCounts, LabelSlots)) else v

        return {f.name: snap(getattr(self, f.name)) for f in dataclasses.fields(self)}


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
