"""Prometheus metrics for /metrics.

Token counters, load gauges and per-step histograms are the scheduler's own numbers (its
`stats()`, fetched over IPC when /metrics is scraped); request latency histograms and requests
finished by reason are measured in the API server, where requests start and end.

Names follow vLLM and SGLang where one of them has the same quantity (docs/server.md lists the
equivalents), with the `minisgl:` prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from minisgl.core import FinishReason
from minisgl.runtime.messages import StatsReply
from minisgl.scheduler.stats import (
    BATCH_SIZE_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    QUEUE_TIME_BUCKETS_S,
)

PREFIX = "minisgl:"
# Buckets in seconds, spanning a fast GPU decode step to a slow CPU prefill.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Exported only when the scheduler runs on CUDA (dashboards show "no data" on CPU).
GPU_METRIC_NAMES = frozenset(
    PREFIX + name
    for name in ("gpu_utilization_ratio", "gpu_memory_used_bytes", "gpu_memory_total_bytes")
)


def _histogram(
    name: str, doc: str, bounds: tuple[float, ...], counts: tuple[int, ...], total: float
) -> HistogramMetricFamily:
    """Per-bucket counts (the last one +Inf) -> a Prometheus histogram (cumulative buckets)."""
    if not counts:  # no snapshot yet
        counts = (0,) * (len(bounds) + 1)
    cumulative = list(itertools.accumulate(counts))
    buckets = [(repr(float(b)), c) for b, c in zip(bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1]))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=total)


class _SchedulerStatsCollector(Collector):
    """Exposes the latest StatsReply as counters, gauges and histograms."""

    def __init__(self, latest: Callable[[], StatsReply | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        stats = self._latest()
        if stats is None:
            return
        # prometheus_client appends `_total` to counter names.
        counters = {
            "prompt_tokens": ("Prompt tokens of admitted requests", stats.prompt_tokens_total),
            "generation_tokens": ("Tokens generated", stats.generation_tokens_total),
            "cached_prompt_tokens": (
                "Prompt tokens served from the prefix cache",
                stats.cached_prompt_tokens_total,
            ),
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                stats.prompt_tokens_total,
            ),
            "prefix_cache_hits": (
                "Prompt tokens found in the prefix cache",
                stats.cached_prompt_tokens_total,
            ),
            "prefill_tokens": (
                "Prompt tokens computed (prefix-cache hits excluded)",
                stats.prefill_tokens_total,
            ),
            "num_retractions": (
                "Running requests retracted (KV freed, requeued) to make room",
                stats.num_retractions_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        gauges: dict[str, tuple[str, float | None]] = {
            "num_running_reqs": ("Requests in the running batch", stats.num_running_reqs),
            "num_queue_reqs": ("Requests waiting to be scheduled", stats.num_queue_reqs),
            "kv_cache_usage_ratio": ("Fraction of KV pages in use", stats.kv_cache_usage_ratio),
            "num_free_kv_pages": ("Free KV pages", stats.num_free_pages),
            "num_total_kv_pages": ("KV pages in the pool", stats.num_total_pages),
            "gen_throughput": (
                "Generated tokens per second over the last few seconds",
                stats.gen_throughput_tokens_per_s,
            ),
            "gpu_utilization_ratio": (
                "Fraction of time a kernel ran on the GPU (NVML)",
                stats.gpu_utilization_ratio,
            ),
            "gpu_memory_used_bytes": (
                "GPU memory in use on the device (all processes)",
                stats.gpu_memory_used_bytes,
            ),
            "gpu_memory_total_bytes": ("GPU memory of the device", stats.gpu_memory_total_bytes),
        }
        for name, (doc, gauge_value) in gauges.items():
            if gauge_value is not None:  # GPU gauges: CUDA only
                yield GaugeMetricFamily(PREFIX + name, doc, value=gauge_value)
        yield _histogram(
            "queue_time_seconds",
            "Time from arrival at the scheduler to first admission",
            QUEUE_TIME_BUCKETS_S,
            stats.queue_time_s_bucket_counts,
            stats.queue_time_s_sum,
        )
        yield _histogram(
            "iteration_num_reqs",
            "Requests in one forward step (decodes and prefill chunks)",
            BATCH_SIZE_BUCKETS,
            stats.batch_size_bucket_counts,
            stats.batch_size_sum,
        )
        yield _histogram(
            "iteration_tokens",
            "Tokens computed in one forward step",
            BATCH_TOKENS_BUCKETS,
            stats.batch_tokens_bucket_counts,
            stats.batch_tokens_sum,
        )


class ServerMetrics:
    def __init__(self, latest_stats: Callable[[], StatsReply | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerStatsCollector(latest_stats))
        self.aborted_requests = Counter(
            PREFIX + "aborted_requests",
            "Requests aborted (client disconnected or shutdown)",
            registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Sequences finished, by finish reason (vLLM's name; abort and error included)",
            labelnames=("finished_reason",),
            registry=self.registry,
        )
        for reason in FinishReason:  # every series exists from the start, at zero
            self.request_success.labels(reason.value)
        self.time_to_first_token_s = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first output token",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency_s = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by route template, method and status code",
            labelnames=("handler", "method", "status"),
            registry=self.registry,
        )
        self.e2e_request_latency_s = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )

    def request_finished(self, reason: FinishReason) -> None:
        """One sequence (one choice of a request) ended."""
        self.request_success.labels(reason.value).inc()
        if reason == FinishReason.ABORT:
            self.aborted_requests.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
