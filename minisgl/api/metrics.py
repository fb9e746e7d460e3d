"""Prometheus metrics for /metrics: the scheduler's own numbers (its stats, fetched when
/metrics is scraped) and the request latencies and finish reasons the API server measures.
Names follow vLLM and SGLang where they have the same quantity (docs/server.md#metrics), with
the `minisgl:` prefix."""

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as MetricFamily
from prometheus_client.registry import Collector

from minisgl.core import FinishReason
from minisgl.runtime.messages import StatsReply
from minisgl.stats import METRIC, Metric, SchedulerStats

PREFIX = "minisgl:"
# Buckets in seconds, spanning a fast GPU decode step to a slow CPU prefill.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# The SchedulerStats fields /metrics exports (those with a Metric), in declaration order.
EXPORTED_FIELDS = tuple(f for f in dataclasses.fields(SchedulerStats) if METRIC in f.metadata)


# A metric kind whose value is one number -> its family (a counter's name gets `_total`).
NUMBER_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _family(metric: Metric, name: str, doc: str, value: Any) -> MetricFamily:
    if metric.kind in NUMBER_FAMILIES:
        return NUMBER_FAMILIES[metric.kind](name, doc, value=value)
    family = HistogramMetricFamily(name, doc, labels=[metric.label] if metric.label else None)
    for labels, snapshot in metric.series(value):  # HistogramSnapshots
        family.add_metric(labels, snapshot.cumulative(metric.bucket_bounds), snapshot.sum)
    return family


class ServerMetrics(Collector):
    """The API server's own metrics, and a collector of the latest StatsReply's
    SchedulerStats: every field with a Metric, as it says."""

    def __init__(self, latest_stats: Callable[[], StatsReply | None]) -> None:
        self._latest_stats = latest_stats
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.aborted_requests = counter(
            f"{PREFIX}aborted_requests", "Requests aborted (client disconnected or shutdown)"
        )
        self.request_success = counter(
            f"{PREFIX}request_success",
            "Sequences finished, by finish reason (vLLM's name; abort and error included)",
            labelnames=("finished_reason",),
        )
        for reason in FinishReason:  # every series exists from the start, at zero
            self.request_success.labels(reason.value)
        self.time_to_first_token_s = histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time from request arrival to its first output token",
            buckets=TTFT_BUCKETS_S,
        )
        self.inter_token_latency_s = histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            buckets=ITL_BUCKETS_S,
        )
        self.http_requests = counter(
            f"{PREFIX}http_requests",
            "HTTP requests answered, by route template, method and status code",
            labelnames=("handler", "method", "status"),
        )
        self.e2e_request_latency_s = histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=E2E_BUCKETS_S,
        )

    def collect(self) -> Iterator[MetricFamily]:
        # None before the scheduler's first reply
        stats = getattr(self._latest_stats(), "stats", None)
        for exported in EXPORTED_FIELDS:
            metric, value = exported.metadata[METRIC], getattr(stats, exported.name, None)
            if value is not None:  # GPU gauges: CUDA only
                for name, doc in metric.names:
                    yield _family(metric, f"{PREFIX}{name}", doc, value)

    def request_finished(self, reason: FinishReason) -> None:
        """One sequence (one choice of a request) ended."""
        self.request_success.labels(reason.value).inc()
        if reason == FinishReason.ABORT:
            self.aborted_requests.inc()

    def count_response(self, handler: str, method: str, status: int) -> None:
        """One HTTP answer, by route template (minisgl.api.middleware.ResponseObserver)."""
        self.http_requests.labels(handler, method, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
