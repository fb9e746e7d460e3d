"""/metrics without a server: the exported names and values, histograms, throughput, GPU probe,
and the scheduler's numbers (retractions, per-step batch sizes) on their way to a StatsReply."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.api.metrics import ServerMetrics
from minisgl.core import FinishReason
from minisgl.engine.gpu_probe import GPU_SAMPLE_INTERVAL_S, GpuProbe, GpuSample, make_gpu_probe
from minisgl.limits import ModelLimits
from minisgl.runtime.messages import StatsReply, decode, encode
from minisgl.scheduler.counters import HistogramCounts, ThroughputWindow
from minisgl.scheduler.process import build_stats_reply
from minisgl.stats import (
    BATCH_SIZE_BUCKETS,
    QUEUE_TIME_BUCKETS_S,
    HistogramSnapshot,
    SchedulerStats,
)
from tests.server_utils import GPU_METRIC_NAMES, parse_metrics
from tests.test_scheduler import GREEDY, NEW_TOKENS, workload

GIB = 1 << 30
RETRACTION_POOL_TOKENS = 168  # test_scheduler's pool that forces retractions on its workload
# Every number the scheduler's stats export on /metrics today, written out by hand: its type and
# help text, and which SchedulerStats value it shows (dashboards and alerts depend on all three).
SCHEDULER_METRICS = {
    "prompt_tokens": ("counter", "Prompt tokens of admitted requests", "prompt_tokens_total"),
    "generation_tokens": ("counter", "Tokens generated", "generation_tokens_total"),
    "embedding_requests": ("counter", "Embedding requests admitted", "embedding_requests_total"),
    "embedding_prompt_tokens": (
        "counter",
        "Prompt tokens of admitted embedding requests",
        "embedding_prompt_tokens_total",
    ),
    "cached_prompt_tokens": (
        "counter",
        "Prompt tokens served from the prefix cache",
        "cached_prompt_tokens_total",
    ),
    "prefix_cache_queries": (
        "counter",
        "Prompt tokens looked up in the prefix cache",
        "prompt_tokens_total",
    ),
    "prefix_cache_hits": (
        "counter",
        "Prompt tokens found in the prefix cache",
        "cached_prompt_tokens_total",
    ),
    "prefill_tokens": (
        "counter",
        "Prompt tokens computed (prefix-cache hits excluded)",
        "prefill_tokens_total",
    ),
    "num_retractions": (
        "counter",
        "Running requests retracted (KV freed, requeued) to make room",
        "num_retractions_total",
    ),
    "spec_decode_num_drafts": (
        "counter",
        "Speculative decoding: times a request's drafts were verified",
        "spec_verify_steps_total",
    ),
    "spec_decode_num_draft_tokens": (
        "counter",
        "Speculative decoding: draft tokens proposed",
        "spec_draft_tokens_total",
    ),
    "spec_decode_num_accepted_tokens": (
        "counter",
        "Speculative decoding: draft tokens accepted",
        "spec_accepted_tokens_total",
    ),
    "spec_accept_length": (
        "gauge",
        "Speculative decoding: mean tokens per verify step (0: none yet)",
        "spec_accept_length",
    ),
    "num_running_reqs": ("gauge", "Requests in the running batch", "num_running_reqs"),
    "num_queue_reqs": ("gauge", "Requests waiting to be scheduled", "num_queue_reqs"),
    "kv_cache_usage_ratio": ("gauge", "Fraction of KV pages in use", "kv_cache_usage_ratio"),
    "num_free_kv_pages": ("gauge", "Free KV pages", "num_free_pages"),
    "num_total_kv_pages": ("gauge", "KV pages in the pool", "num_total_pages"),
    "gen_throughput": (
        "gauge",
        "Generated tokens per second over the last few seconds",
        "gen_throughput_tokens_per_s",
    ),
    "gpu_utilization_ratio": (
        "gauge",
        "Fraction of time a kernel ran on the GPU (NVML)",
        "gpu_utilization_ratio",
    ),
    "gpu_memory_used_bytes": (
        "gauge",
        "GPU memory in use on the device (all processes)",
        "gpu_memory_used_bytes",
    ),
    "gpu_memory_total_bytes": ("gauge", "GPU memory of the device", "gpu_memory_total_bytes"),
    "queue_time_seconds": (
        "histogram",
        "Time from arrival at the scheduler to first admission",
        "queue_time_s",
    ),
    "iteration_num_reqs": (
        "histogram",
        "Requests in one forward step (decodes and prefill chunks)",
        "batch_size",
    ),
    "iteration_tokens": ("histogram", "Tokens computed in one forward step", "batch_tokens"),
    "queue_time_by_priority_seconds": (
        "histogram",
        "Queue time by request priority",
        "queue_time_by_priority_s",
    ),
    "queue_time_by_tenant_seconds": (
        "histogram",
        "Queue time by tenant (user, else API key)",
        "queue_time_by_tenant_s",
    ),
}
# The labelled ones: one series per label value (bounded: minisgl.stats).
METRIC_LABELS = {
    "queue_time_by_priority_seconds": "priority",
    "queue_time_by_tenant_seconds": "tenant",
}


def stats(**values) -> SchedulerStats:
    """A SchedulerStats of zeros, but for `values`."""
    required = [
        f.name
        for f in dataclasses.fields(SchedulerStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    return SchedulerStats(**(dict.fromkeys(required, 0) | values))


def reply_of(scheduler_stats: SchedulerStats) -> StatsReply:
    return StatsReply(1, 128, 10, eos_token_ids=(2,), kv_capacity_tokens=64, stats=scheduler_stats)


def render(reply: StatsReply | None, metrics: ServerMetrics | None = None) -> dict[str, float]:
    metrics = metrics or ServerMetrics(lambda: reply)
    return parse_metrics(metrics.render().decode())


def test_histogram_counts_use_le_buckets():
    hist = HistogramCounts((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 7.0):
        hist.observe(value)
    snap = hist.snapshot()
    assert snap.bucket_counts == (2, 2, 1)  # <=1, (1, 2], +Inf
    assert snap.count == 5 and snap.sum == pytest.approx(12.0)


def test_throughput_window():
    window = ThroughputWindow(window_s=10.0)
    assert window.update(0.0, 0) == 0.0
    assert window.update(1.0, 10) == pytest.approx(10.0)
    assert window.update(5.0, 50) == pytest.approx(10.0)
    assert window.update(20.0, 50) == pytest.approx(0.0)  # idle for longer than the window


def test_scheduler_numbers_are_exported():
    queue_counts = (1, 2) + (0,) * (len(QUEUE_TIME_BUCKETS_S) - 2) + (3,)
    reply = reply_of(
        stats(
            prompt_tokens_total=100,
            cached_prompt_tokens_total=40,
            prefill_tokens_total=60,
            generation_tokens_total=7,
            num_retractions_total=3,
            gen_throughput_tokens_per_s=12.5,
            queue_time_s=HistogramSnapshot(queue_counts, 99.0),
        )
    )
    assert decode(encode(reply)) == reply
    values = render(reply)
    assert values["minisgl:prefix_cache_queries_total"] == 100
    assert values["minisgl:prefix_cache_hits_total"] == 40
    assert values["minisgl:cached_prompt_tokens_total"] == 40
    assert values["minisgl:prefill_tokens_total"] == 60
    assert values["minisgl:num_retractions_total"] == 3
    assert values["minisgl:gen_throughput"] == 12.5
    first, second = (repr(b) for b in QUEUE_TIME_BUCKETS_S[:2])
    assert values[f'minisgl:queue_time_seconds_bucket{{le="{first}"}}'] == 1
    assert values[f'minisgl:queue_time_seconds_bucket{{le="{second}"}}'] == 3  # cumulative
    assert values['minisgl:queue_time_seconds_bucket{le="+Inf"}'] == 6
    assert values["minisgl:queue_time_seconds_count"] == 6
    assert values["minisgl:queue_time_seconds_sum"] == 99.0
    # No snapshot yet: the histograms still exist, empty.
    assert values["minisgl:iteration_num_reqs_count"] == 0
    assert not GPU_METRIC_NAMES & values.keys()  # CPU: no GPU gauges at all


def test_gpu_gauges_only_with_gpu_numbers():
    reply = reply_of(
        stats(
            gpu_utilization_ratio=0.25,
            gpu_memory_used_bytes=3 * GIB,
            gpu_memory_total_bytes=8 * GIB,
        )
    )
    values = render(reply)
    assert values.keys() >= GPU_METRIC_NAMES
    assert values["minisgl:gpu_utilization_ratio"] == 0.25
    assert values["minisgl:gpu_memory_used_bytes"] == 3 * GIB


def test_requests_finished_by_reason():
    metrics = ServerMetrics(lambda: None)
    values = render(None, metrics)
    for reason in FinishReason:  # every series exists from the start
        assert values[f'minisgl:request_success_total{{finished_reason="{reason.value}"}}'] == 0
    for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.LENGTH, FinishReason.ABORT):
        metrics.request_finished(reason)
    values = render(None, metrics)
    assert values['minisgl:request_success_total{finished_reason="length"}'] == 2
    assert values['minisgl:request_success_total{finished_reason="stop"}'] == 1
    assert values['minisgl:request_success_total{finished_reason="abort"}'] == 1
    assert values["minisgl:aborted_requests_total"] == 1


def test_gpu_probe(monkeypatch):
    assert make_gpu_probe("cpu", None) is None
    calls = itertools.count()

    def mem_get_info(device):
        next(calls)
        return 2 * GIB, 8 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 37)
    probe = make_gpu_probe("cuda", 1)
    assert isinstance(probe, GpuProbe) and probe.device_index == 1
    sample = probe.sample(0.0)
    assert sample is not None
    assert sample.gpu_utilization_ratio == pytest.approx(0.37)
    assert (sample.gpu_memory_used_bytes, sample.gpu_memory_total_bytes) == (6 * GIB, 8 * GIB)
    assert probe.sample(GPU_SAMPLE_INTERVAL_S / 2) is sample  # not read again so soon
    assert next(calls) == 1

    def no_nvml(device):
        raise ModuleNotFoundError("nvidia-ml-py")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    later = probe.sample(2 * GPU_SAMPLE_INTERVAL_S)
    assert later is not None and later.gpu_utilization_ratio is None  # memory still reported
    assert later.gpu_memory_total_bytes == 8 * GIB


def test_retractions_and_batches_reach_metrics(tiny_qwen3):
    """A real scheduler: retractions under a tiny pool, then exact per-step batch books."""
    llm = LLM(str(tiny_qwen3), dtype="float32", num_pages=RETRACTION_POOL_TOKENS)
    try:
        llm.generate(workload(), GREEDY)
        stats = llm.scheduler.stats()
        assert stats.num_retractions_total > 0
        reply = build_stats_reply(llm.scheduler, ThroughputWindow(), None)
        values = render(reply)
        assert values["minisgl:num_retractions_total"] == stats.num_retractions_total
        assert values["minisgl:prefill_tokens_total"] == stats.prefill_tokens_total
        assert values["minisgl:iteration_num_reqs_count"] == stats.batch_size.count > 0
    finally:
        llm.shutdown()

    # Overlap off, no shared prefixes, every prompt in one chunk: each request is one prefill
    # chunk, then one single-token decode per further output token.
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + n)) for i, n in enumerate((9, 30, 51))]
    llm = LLM(str(tiny_qwen3), dtype="float32", num_pages=1024, disable_overlap=True)
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        stats = llm.scheduler.stats()
        num_decodes = len(prompts) * (NEW_TOKENS - 1)
        assert stats.prefill_tokens_total == sum(map(len, prompts))
        assert stats.batch_tokens.sum == stats.prefill_tokens_total + num_decodes
        assert stats.batch_size.sum == len(prompts) + num_decodes
        assert len(stats.batch_size.bucket_counts) == len(BATCH_SIZE_BUCKETS) + 1
        assert stats.queue_time_s.count == 0  # offline requests carry no arrival time
    finally:
        llm.shutdown()


def test_build_stats_reply_adds_the_process_numbers():
    """The scheduler's own stats pass through whole; this process adds throughput and GPU."""
    scheduler_stats = stats(num_running_reqs=1, prompt_tokens_total=5, num_total_pages=4)
    scheduler = SimpleNamespace(
        stats=lambda: scheduler_stats,
        limits=ModelLimits(max_model_len=64, vocab_size=32, kv_capacity_tokens=4 * 16),
        eos_token_ids=[2],
    )
    gpu = SimpleNamespace(sample=lambda now_s: GpuSample(0.5, 3 * GIB, 8 * GIB))
    reply = build_stats_reply(scheduler, ThroughputWindow(), gpu)  # type: ignore[arg-type]
    assert (reply.max_model_len, reply.vocab_size, reply.eos_token_ids) == (64, 32, (2,))
    assert reply.kv_capacity_tokens == 4 * 16
    assert reply.stats == dataclasses.replace(
        scheduler_stats,
        gpu_utilization_ratio=0.5,
        gpu_memory_used_bytes=3 * GIB,
        gpu_memory_total_bytes=8 * GIB,
    )
    assert build_stats_reply(scheduler, ThroughputWindow(), None).stats == scheduler_stats


def test_every_scheduler_metric_keeps_its_name_type_and_help():
    """Each metric is exported from one SchedulerStats field, as it always was: exact names,
    types and help texts, each showing its own value."""
    values = {name: 10.0 + i for i, name in enumerate(SchedulerStats.__dataclass_fields__)}
    histogram = HistogramSnapshot((1, 2) + (0,) * 12, 7.0)
    for name in ("queue_time_s", "batch_size", "batch_tokens"):
        values[name] = dataclasses.replace(histogram, sum=values[name])  # type: ignore[assignment]
    for name in ("queue_time_by_priority_s", "queue_time_by_tenant_s"):
        values[name] = {"x": dataclasses.replace(histogram, sum=values[name])}  # type: ignore[assignment]
    values["num_queue_reqs_by_priority"] = {}  # type: ignore[assignment]
    text = ServerMetrics(lambda: reply_of(SchedulerStats(**values))).render().decode()
    families = {
        line.split()[2]: line.split()[3]
        for line in text.splitlines()
        if line.startswith("# TYPE minisgl:")
    }
    helps = {
        line.split()[2]: line.split(" ", 3)[3]
        for line in text.splitlines()
        if line.startswith("# HELP minisgl:")
    }
    parsed = parse_metrics(text)
    exposed = set()
    for name, (kind, help_text, field_name) in SCHEDULER_METRICS.items():
        shown = f"minisgl:{name}_total" if kind == "counter" else f"minisgl:{name}"
        exposed.add(shown)
        assert (families[shown], helps[shown]) == (kind, help_text), name
        value = values[field_name]
        if kind == "counter":
            assert parsed[f"minisgl:{name}_total"] == value
        elif kind == "gauge":
            assert parsed[f"minisgl:{name}"] == value
        else:
            series = f'{{{METRIC_LABELS[name]}="x"}}' if name in METRIC_LABELS else ""
            value = value["x"] if series else value  # type: ignore[index]
            assert parsed[f"minisgl:{name}_sum{series}"] == value.sum  # type: ignore[union-attr]
            assert parsed[f"minisgl:{name}_count{series}"] == 3
    server_side = {
        "minisgl:aborted_requests_total",
        "minisgl:request_success_total",
        "minisgl:time_to_first_token_seconds",
        "minisgl:inter_token_latency_seconds",
        "minisgl:http_requests_total",
        "minisgl:e2e_request_latency_seconds",
    }
    created = {name for name in families if name.endswith("_created")}  # prometheus_client's own
    assert families.keys() - created == exposed | server_side
