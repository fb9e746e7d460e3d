"""The scheduler's numbers as the API server sees them: `SchedulerStats`, one snapshot for
/metrics and tests, each field carrying how /metrics exports it (its `Metric`).

The scheduler (minisgl.scheduler.counters) and its process (throughput, GPU) fill it in, and a
new metric is one new field (docs/server.md#metrics). Plain Python: both sides import it."""

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

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
    empty = HistogramSnapshot((0,) * (len(bounds) + 1), 0.0)
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
    embedding_requests_total: int = _counter(("embedding_requests", "Embedding requests admitted"))
    embedding_prompt_tokens_total: int = _counter(
        ("embedding_prompt_tokens", "Prompt tokens of admitted embedding requests")
    )
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
    # The scheduler process's own numbers (minisgl.scheduler.process); offline, the defaults.
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
