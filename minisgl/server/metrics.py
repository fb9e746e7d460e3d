"""Prometheus metrics for /metrics.

Token counters and load gauges are the scheduler's own numbers (its `stats()`, fetched over IPC
when /metrics is scraped); latency histograms and the abort counter are measured in the API
server, where requests start and end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minisgl.message import StatsReply

PREFIX = "minisgl:"
# Buckets in seconds, spanning a fast GPU decode step to a slow CPU prefill.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _SchedulerStatsCollector(Collector):
    """Exposes the latest StatsReply as counters and gauges."""

    def __init__(self, latest: Callable[[], StatsReply | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        stats = self._latest()
        if stats is None:
            return
        counters = {
            "prompt_tokens": ("Prompt tokens processed", stats.prompt_tokens_total),
            "generation_tokens": ("Tokens generated", stats.generation_tokens_total),
            "cached_prompt_tokens": (
                "Prompt tokens served from the prefix cache",
                stats.cached_prompt_tokens_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        gauges: dict[str, tuple[str, float]] = {
            "num_running_reqs": ("Requests in the running batch", stats.num_running_reqs),
            "num_queue_reqs": ("Requests waiting to be scheduled", stats.num_queue_reqs),
            "kv_cache_usage_ratio": ("Fraction of KV pages in use", stats.kv_cache_usage_ratio),
            "num_free_kv_pages": ("Free KV pages", stats.num_free_pages),
            "num_total_kv_pages": ("KV pages in the pool", stats.num_total_pages),
        }
        for name, (doc, gauge_value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=gauge_value)


class ServerMetrics:
    def __init__(self, latest_stats: Callable[[], StatsReply | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerStatsCollector(latest_stats))
        self.aborted_requests = Counter(
            PREFIX + "aborted_requests",
            "Requests aborted (client disconnected or shutdown)",
            registry=self.registry,
        )
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
        self.e2e_request_latency_s = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
