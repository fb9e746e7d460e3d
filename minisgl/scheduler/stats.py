"""The scheduler's numbers for /metrics and tests: counters, per-step histograms, throughput.

`SchedulerStats` is their one definition: each field carries, as dataclass metadata, how /metrics
exports it (its `Metric`: kind, name(s), help text). The scheduler fills in its own numbers, the
scheduler process adds its process-level ones (throughput, GPU), the StatsReply message carries
the whole snapshot to the API server, and the Prometheus collector there (minisgl.api.metrics)
exports every field that has a Metric. A new metric is one new field.

Everything here is plain Python (no torch): the API server imports it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from minisgl.scheduler.policy import tenant_of

if TYPE_CHECKING:
    from minisgl.core import Req

# Histogram bucket upper bounds (Prometheus `le`); values above the last go to +Inf.
# Queue time: from arrival at the scheduler to first admission, a fast GPU step to a long backlog.
QUEUE_TIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Requests in one forward step (decodes plus prefill chunks).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Tokens computed in one forward step (one per decode plus each prefill chunk's length).
BATCH_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Generation throughput is averaged over this much recent time, as SGLang's log interval does.
GEN_THROUGHPUT_WINDOW_S = 10.0
# A labelled metric keeps its label set bounded: values past the first this many (priorities,
# tenants) share the series OTHER_LABEL.
MAX_LABEL_VALUES = 16
OTHER_LABEL = "other"


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observation counts per bucket (not cumulative; one more than the bounds: +Inf) and sum."""

    bucket_counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    def cumulative(self, bounds: tuple[float, ...]) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, observations up to it), the last one +Inf."""
        counts = list(itertools.accumulate(self.bucket_counts))
        return [*zip([repr(float(b)) for b in bounds], counts, strict=False), ("+Inf", counts[-1])]


@dataclass
class HistogramCounts:
    """A histogram the scheduler fills in; cheap enough to observe every step."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    sum: float = 0.0  # of the observed values

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(tuple(self.counts), self.sum)


def _histogram_counts(bounds: tuple[float, ...]) -> Any:
    return field(default_factory=lambda: HistogramCounts(bounds))


def _observe(series: dict[str, HistogramCounts], label: str, value: float) -> None:
    """Into the series of `label`, or OTHER_LABEL's once MAX_LABEL_VALUES labels exist."""
    if label not in series and len(series) >= MAX_LABEL_VALUES:
        label = OTHER_LABEL
    series.setdefault(label, HistogramCounts(QUEUE_TIME_BUCKETS_S)).observe(value)


@dataclass
class SchedulerCounters:
    """The scheduler's counters (totals since start) and per-step histograms: what `stats()`
    reports, under the names of their `SchedulerStats` fields."""

    prompt_tokens_total: int = 0  # prompt tokens looked up in the prefix cache (first admission)
    cached_prompt_tokens_total: int = 0  # of those, tokens found in the cache
    prefill_tokens_total: int = 0  # prompt tokens actually computed (cache hits excluded)
    generation_tokens_total: int = 0
    # speculative decoding: verify steps (a request's drafts checked once), drafts, accepted ones
    spec_verify_steps_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    queue_time_s: HistogramCounts = _histogram_counts(QUEUE_TIME_BUCKETS_S)
    batch_size: HistogramCounts = _histogram_counts(BATCH_SIZE_BUCKETS)
    batch_tokens: HistogramCounts = _histogram_counts(BATCH_TOKENS_BUCKETS)
    queue_time_by_priority_s: dict[str, HistogramCounts] = field(default_factory=dict)
    queue_time_by_tenant_s: dict[str, HistogramCounts] = field(default_factory=dict)

    def first_admission(self, req: Req) -> None:
        """A request admitted for the first time (not after a retraction), its prefix matched."""
        self.prompt_tokens_total += req.prompt_len
        self.cached_prompt_tokens_total += req.cached_len
        if req.arrival_time > 0:  # set by the server; offline requests have none
            queue_time_s = time.monotonic() - req.arrival_time
            self.queue_time_s.observe(queue_time_s)
            _observe(self.queue_time_by_priority_s, str(req.sampling_params.priority), queue_time_s)
            _observe(self.queue_time_by_tenant_s, tenant_of(req), queue_time_s)

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

        def snap(v: Any) -> Any:  # a labelled histogram is a dict of them
            if isinstance(v, dict):
                return {label: snap(series) for label, series in v.items()}
            return v.snapshot() if isinstance(v, HistogramCounts) else v

        return {f.name: snap(getattr(self, f.name)) for f in dataclasses.fields(self)}


MetricKind = Literal["counter", "gauge", "histogram"]
METRIC = "metric"  # the dataclass metadata key


@dataclass(frozen=True)
class Metric:
    """How /metrics exports one SchedulerStats field. Several (name, help) pairs export one value
    under several names: where vLLM's and SGLang's names for it differ, both. Names are without
    the `minisgl:` prefix, counters without the `_total` that Prometheus appends. A gauge whose
    value is None is not exported (the GPU's, off CUDA)."""

    kind: MetricKind
    names: tuple[tuple[str, str], ...]  # (name, help)
    bucket_bounds: tuple[float, ...] = ()  # histograms: the buckets' upper bounds
    label: str | None = None  # a labelled histogram: its value maps label values to snapshots

    def series(self, value: Any) -> list[tuple[list[str], Any]]:
        """(label values, value) of each series the field exports."""
        return [([k], v) for k, v in value.items()] if self.label else [([], value)]


def _exported(
    kind: MetricKind, names: tuple[tuple[str, str], ...], bounds: tuple[float, ...] = (), **kw: Any
) -> Any:
    """A SchedulerStats field exported as `kind`; `kw` go to dataclasses.field (a default)."""
    return field(metadata={METRIC: Metric(kind, names, bounds)}, **kw)


def _gauge(name: str, help_text: str, **kw: Any) -> Any:
    return _exported("gauge", ((name, help_text),), **kw)


def _counter(*names: tuple[str, str]) -> Any:
    return _exported("counter", names)


def _histogram(name: str, help_text: str, bounds: tuple[float, ...]) -> Any:
    """Empty (zero counts) until observed."""
    empty = HistogramCounts(bounds).snapshot()
    return _exported("histogram", ((name, help_text),), bounds, default=empty)


def _by_label(name: str, help_text: str, label: str) -> Any:
    """A queue-time histogram per `label` value (no series until observed)."""
    metric = Metric("histogram", ((name, help_text),), QUEUE_TIME_BUCKETS_S, label)
    return field(metadata={METRIC: metric}, default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for /metrics and tests. Counters are totals since start."""

    num_running_reqs: int = _gauge("num_running_reqs", "Requests in the running batch")
    num_queue_reqs: int = _gauge("num_queue_reqs", "Requests waiting to be scheduled")
    # Pages held by live requests (and their locked prefixes) / all.
    kv_cache_usage_ratio: float = _gauge("kv_cache_usage_ratio", "Fraction of KV pages in use")
    num_free_pages: int = _gauge("num_free_kv_pages", "Free KV pages")  # free list + evictable
    num_total_pages: int = _gauge("num_total_kv_pages", "KV pages in the pool")
    # Prompt tokens looked up in the prefix cache (first admission).
    prompt_tokens_total: int = _counter(
        ("prompt_tokens", "Prompt tokens of admitted requests"),
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    )
    generation_tokens_total: int = _counter(("generation_tokens", "Tokens generated"))
    # Of those, tokens found in the cache.
    cached_prompt_tokens_total: int = _counter(
        ("cached_prompt_tokens", "Prompt tokens served from the prefix cache"),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    )
    # Prompt tokens actually computed (cache hits excluded).
    prefill_tokens_total: int = _counter(
        ("prefill_tokens", "Prompt tokens computed (prefix-cache hits excluded)")
    )
    num_retractions_total: int = _counter(
        ("num_retractions", "Running requests retracted (KV freed, requeued) to make room")
    )
    spec_verify_steps_total: int = _counter(
        ("spec_decode_num_drafts", "Speculative decoding: times a request's drafts were verified")
    )
    spec_draft_tokens_total: int = _counter(
        ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed")
    )
    spec_accepted_tokens_total: int = _counter(
        ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted")
    )
    # SGLang's: accepted drafts + 1 per verify step, the tokens one verify yields on average.
    spec_accept_length: float = _gauge(
        "spec_accept_length", "Speculative decoding: mean tokens per verify step (0: none yet)"
    )
    queue_time_s: HistogramSnapshot = _histogram(
        "queue_time_seconds",
        "Time from arrival at the scheduler to first admission",
        QUEUE_TIME_BUCKETS_S,
    )
    queue_time_by_priority_s: dict[str, HistogramSnapshot] = _by_label(
        "queue_time_by_priority_seconds", "Queue time by request priority", "priority"
    )
    queue_time_by_tenant_s: dict[str, HistogramSnapshot] = _by_label(
        "queue_time_by_tenant_seconds", "Queue time by tenant (user, else API key)", "tenant"
    )
    # /get_load: waiting requests by priority (not a metric: as many series as priorities)
    num_queue_reqs_by_priority: dict[str, int] = field(default_factory=dict)
    batch_size: HistogramSnapshot = _histogram(
        "iteration_num_reqs",
        "Requests in one forward step (decodes and prefill chunks)",
        BATCH_SIZE_BUCKETS,
    )
    batch_tokens: HistogramSnapshot = _histogram(
        "iteration_tokens", "Tokens computed in one forward step", BATCH_TOKENS_BUCKETS
    )
    # The scheduler process's own numbers (minisgl.runtime.scheduler_proc); offline, the defaults.
    gen_throughput_tokens_per_s: float = _gauge(
        "gen_throughput", "Generated tokens per second over the last few seconds", default=0.0
    )
    # The scheduler's GPU (rank 0's with tp); None on CPU or when it cannot be read.
    gpu_utilization_ratio: float | None = _gauge(
        "gpu_utilization_ratio", "Fraction of time a kernel ran on the GPU (NVML)", default=None
    )
    gpu_memory_used_bytes: int | None = _gauge(
        "gpu_memory_used_bytes", "GPU memory in use on the device (all processes)", default=None
    )
    gpu_memory_total_bytes: int | None = _gauge(
        "gpu_memory_total_bytes", "GPU memory of the device", default=None
    )


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
