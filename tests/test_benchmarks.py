"""The online benchmarks, the plot script and the Grafana dashboard against real servers.

Two servers with a tiny random model (radix and naive prefix cache) are shared by the module.
Each benchmark runs as its users run it (a subprocess, a few seconds, bounded), and its JSON-lines
results are checked against what was sent: request counts, token counts from usage (exact, since
every request has ignore_eos), ordered percentiles, and the prefix-cache hit rate.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.server_utils import GPU_METRIC_NAMES, ServerProcess, start_server

ROOT = Path(__file__).resolve().parents[1]
ONLINE = ROOT / "benchmark" / "online"
MONITORING = ROOT / "examples" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "minisgl.json"
# The benchmarks and the preview are scripts, not a package: import them from their folders.
sys.path[:0] = [str(ONLINE), str(ROOT / "scripts")]
import bench_common  # noqa: E402
import bench_qwen  # noqa: E402
import bench_serving  # noqa: E402
import dashboard_preview  # noqa: E402
import make_trace  # noqa: E402

BENCH_TIMEOUT_S = 180.0
NUM_TRACE_REQUESTS = 10
TRACE_SCALES = "0.03,0.06"  # the first 10 lines span ~20 s: replayed in about 1 s each
GSP_GROUPS, GSP_PER_GROUP, GSP_OUTPUT_LEN = 2, 3, 6
NUM_RANDOM_PROMPTS = 4
RANDOM_OUTPUT_LEN = 5
STATS_ORDER = ("p50", "p90", "p99", "max")
METRIC_NAME = re.compile(r"\bminisgl:[a-zA-Z0-9_:]+")
PLOT_SIZE_PX = (600, 800)  # rows, columns: benchmark/plot.py's FIGURE_SIZE_IN x DPI


@pytest.fixture(scope="module")
def servers(tiny_qwen3) -> dict[str, ServerProcess]:
    started = {
        cache: start_server("--model", str(tiny_qwen3), "--cache", cache)
        for cache in ("radix", "naive")
    }
    try:
        for srv in started.values():
            srv.wait_healthy()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def run_bench(script: str, *args: str) -> None:
    command = [sys.executable, str(ONLINE / script), "--disable-tqdm", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_record(
    record: dict[str, Any], num_requests: int, input_tokens: int, output_tokens: int
) -> None:
    """A result line against what the test sent: `input_tokens` counted by the test itself
    (HF's tokenizer and chat template, or the trace's lengths), `output_tokens` as requested
    (every request has ignore_eos). The rates are those counts over the run's duration."""
    assert record["num_requests"] == record["completed"] == num_requests, record["errors"]
    assert record["failed"] == 0 and record["errors"] == []
    assert record["total_input_tokens"] == input_tokens
    assert record["total_output_tokens"] == record["expected_output_tokens"] == output_tokens
    for name in ("ttft", "tpot", "itl", "e2el"):
        values = [record[f"{stat}_{name}_ms"] for stat in STATS_ORDER]
        assert all(v is not None and v >= 0 for v in values), (name, values)
        assert values == sorted(values), (name, values)
    assert record["p99_ttft_ms"] <= record["max_e2el_ms"]
    duration_s = record["duration_s"]
    assert record["max_e2el_ms"] <= duration_s * 1000  # every request ran within the run
    assert record["request_throughput"] == pytest.approx(num_requests / duration_s)
    assert record["output_throughput"] == pytest.approx(output_tokens / duration_s)
    assert record["total_token_throughput"] == pytest.approx(
        (input_tokens + output_tokens) / duration_s
    )
    # The server's prefix-cache counters over the run (from /metrics) agree with the usage the
    # client summed: every prompt token was looked up once, and the hits are the cached tokens.
    assert record["server_cache_query_tokens"] == input_tokens
    hits = record["server_cache_hit_tokens"]
    assert hits == record["usage_cached_tokens"]
    assert record["prefix_cache_hit_rate"] == pytest.approx(hits / input_tokens)
    assert record["usage_cache_hit_rate"] == pytest.approx(hits / input_tokens)
    assert record["date"] and record["command"].startswith("python")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt HF's chat template makes of one user message, ready for the reply."""
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def trace_results(servers, tmp_path_factory) -> dict[str, Path]:
    """bench_qwen on the bundled trace, against both servers at once."""
    out = tmp_path_factory.mktemp("trace_results")
    files = {cache: out / f"{cache}.jsonl" for cache in servers}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ONLINE / "bench_qwen.py"),
                "--disable-tqdm",
                f"--base-url={srv.url}",
                f"--num-requests={NUM_TRACE_REQUESTS}",
                f"--scales={TRACE_SCALES}",
                f"--label={cache}",
                f"--output-file={files[cache]}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cache, srv in servers.items()
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=BENCH_TIMEOUT_S)
        assert proc.returncode == 0, output
    return files


def trace_prompts(seed: int) -> list[list[int]]:
    records = bench_qwen.load_trace(bench_qwen.DEFAULT_TRACE, NUM_TRACE_REQUESTS)
    prompts = bench_qwen.BlockPrompts(seed, bench_qwen.DEFAULT_TOKEN_ID_RANGE)
    return [prompts.prompt(r) for r in records]


def shared_prefix_upper_bound(prompts: list[list[int]]) -> int:
    """Prompt tokens a prefix cache could possibly serve: for each prompt, its longest common
    prefix with any other prompt, less the last token (always computed)."""
    total = 0
    for i, prompt in enumerate(prompts):
        best = max(common_prefix_len(prompt, other) for j, other in enumerate(prompts) if j != i)
        total += min(best, len(prompt) - 1)
    return total


def test_trace_replay(trace_results):
    records = bench_qwen.load_trace(bench_qwen.DEFAULT_TRACE, NUM_TRACE_REQUESTS)
    expected_input = sum(r.input_length for r in records)
    expected_output = sum(r.output_length for r in records)
    for cache, path in trace_results.items():
        runs = read_jsonl(path)
        assert [r["scale"] for r in runs] == [float(s) for s in TRACE_SCALES.split(",")]
        for index, run in enumerate(runs):
            # Token-id prompts: the server saw exactly the trace's lengths.
            check_record(run, NUM_TRACE_REQUESTS, expected_input, expected_output)
            assert run["label"] == cache
            assert run["expected_input_tokens"] == expected_input
            prompts = trace_prompts(index)  # each scale: its own seed
            assert [len(p) for p in prompts] == [r.input_length for r in records]
            # How much the radix cache serves depends on arrival timing: at most what the
            # prompts share, and some of it (multi-turn children follow their parents)
            if cache == "radix":
                assert 0 < run["server_cache_hit_tokens"] <= shared_prefix_upper_bound(prompts)
            else:
                assert run["server_cache_hit_tokens"] == 0


def test_serving_benchmark(servers, hf_tokenizer, tmp_path):
    num_gsp = GSP_GROUPS * GSP_PER_GROUP
    gsp_args = [
        "--dataset=shared-prefix",
        f"--gsp-num-groups={GSP_GROUPS}",
        f"--gsp-prompts-per-group={GSP_PER_GROUP}",
        "--gsp-system-prompt-len=64",
        "--gsp-question-len=8",
        f"--gsp-output-len={GSP_OUTPUT_LEN}",
        "--request-rate=50",
    ]
    # The benchmark's own prompts (its seed 0, first rate), tokenized here by HF
    gsp = bench_serving.build_dataset(bench_serving.parse_args(gsp_args), 0, None)
    gsp_prompts = [chat_prompt_ids(hf_tokenizer, d.prompt) for d in gsp]
    for cache, srv in servers.items():
        out = tmp_path / f"gsp_{cache}.jsonl"
        run_bench("bench_serving.py", f"--base-url={srv.url}", f"--output-file={out}", *gsp_args)
        (record,) = read_jsonl(out)
        check_record(record, num_gsp, sum(map(len, gsp_prompts)), num_gsp * GSP_OUTPUT_LEN)
        assert record["dataset"] == "shared-prefix" and record["request_rate"] == 50
        # Prompts of a group share their system prompt; how much of it the cache serves
        # depends on arrival timing (at 50 req/s most arrive after their group's first one)
        if cache == "radix":
            assert 0 < record["server_cache_hit_tokens"] <= shared_prefix_upper_bound(gsp_prompts)
        else:
            assert record["server_cache_hit_tokens"] == 0
    # Random prompts at a fixed concurrency, two rates, the completions API.
    random_args = [
        "--backend=openai",
        f"--num-prompts={NUM_RANDOM_PROMPTS}",
        "--random-input-len=32",
        f"--random-output-len={RANDOM_OUTPUT_LEN}",
        "--request-rate=inf,100",
        "--max-concurrency=2",
    ]
    out = tmp_path / "random.jsonl"
    run_bench(
        "bench_serving.py", f"--base-url={servers['radix'].url}", f"--output-file={out}",
        *random_args,
    )  # fmt: skip
    runs = read_jsonl(out)
    assert [r["request_rate"] for r in runs] == [None, 100]  # inf is not JSON: null
    for index, record in enumerate(runs):  # each rate draws its prompts with seed 0 + index
        dataset = bench_serving.build_dataset(bench_serving.parse_args(random_args), index, None)
        assert [len(d.prompt.split()) for d in dataset] == [32] * NUM_RANDOM_PROMPTS
        input_tokens = sum(len(hf_tokenizer(d.prompt)["input_ids"]) for d in dataset)
        check_record(
            record, NUM_RANDOM_PROMPTS, input_tokens, NUM_RANDOM_PROMPTS * RANDOM_OUTPUT_LEN
        )


def test_sharegpt_file_and_warmup(servers, hf_tokenizer, tmp_path):
    replies = ["x" * 40, "y" * 22, "z" * 61]  # 10, 6 (22 / 4 rounded) and 15 tokens estimated
    conversations = [
        {"conversations": [{"from": "human", "value": f"Question {i} about the sea?"}, reply]}
        for i, reply in enumerate({"from": "gpt", "value": r} for r in replies)
    ]
    conversations.insert(1, {"conversations": [{"from": "human", "value": "no reply"}]})
    conversations.append({"conversations": [{"from": "human", "value": "hi"}, {"value": "ok"}]})
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    srv = servers["radix"]
    flush = httpx.post(srv.url + "/flush_cache", timeout=60)  # SGLang's: an empty prefix cache
    assert flush.status_code == 200, flush.text
    finished = 'minisgl:request_success_total{finished_reason="length"}'
    before = srv.metrics()[finished]
    out = tmp_path / "sharegpt.jsonl"
    run_bench(
        "bench_serving.py",
        f"--base-url={srv.url}",
        f"--output-file={out}",
        "--dataset=sharegpt",
        f"--dataset-path={dataset}",
        "--num-prompts=10",  # more than the file has: the 3 usable ones are sent
        "--num-warmup=2",
        "--max-concurrency=1",
    )
    (record,) = read_jsonl(out)
    prompts = [chat_prompt_ids(hf_tokenizer, f"Question {i} about the sea?") for i in range(3)]
    check_record(record, len(replies), sum(map(len, prompts)), 10 + 6 + 15)
    # Two warm-up requests reached the server, and no result counts them.
    assert srv.metrics()[finished] - before == len(replies) + 2
    # One request at a time after the warm-ups, from an empty cache (page size 1): the first
    # question finds the template's head the warm-ups left (their prompts are lowercase
    # words), the other two all the tokens the questions share.
    head = common_prefix_len(prompts[0], chat_prompt_ids(hf_tokenizer, "the"))
    shared = common_prefix_len(prompts[0], prompts[1])
    assert common_prefix_len(prompts[1], prompts[2]) == common_prefix_len(prompts[0], prompts[2])
    assert shared == common_prefix_len(prompts[0], prompts[2]) > head > 0
    assert record["server_cache_hit_tokens"] == head + 2 * shared


def test_plot_draws_png(trace_results, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "plot.png"
    files = [str(trace_results["radix"]), str(trace_results["naive"])]
    command = [sys.executable, str(ROOT / "benchmark" / "plot.py"), *files, f"--out={out}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    image = imread(out)
    assert image.shape[:2] == PLOT_SIZE_PX
    assert image.std() > 0  # not a blank canvas


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    return queries


def test_dashboard_metrics_are_exported(servers):
    srv = servers["radix"]
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    exported = {name.split("{")[0] for name in srv.metrics()}
    used = {name for query in dashboard_queries() for name in METRIC_NAME.findall(query)}
    assert len(used) >= 15
    missing = used - exported
    # GPU gauges exist only on CUDA; everything else must be served right now.
    assert missing <= GPU_METRIC_NAMES, sorted(missing - GPU_METRIC_NAMES)
    assert {"minisgl:gpu_utilization_ratio", "minisgl:gpu_memory_used_bytes"} <= used


def test_every_dashboard_panel_shows_data(servers, tmp_path):
    """Each panel's PromQL, evaluated on two live scrapes with one request between them, gives
    finite numbers (GPU panels: no data on CPU); the preview draws them."""
    srv = servers["radix"]
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [7, 8, 9], "max_tokens": 4, "ignore_eos": True}
    first = dashboard_preview.parse_scrape(httpx.get(srv.url + "/metrics").text)
    assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    second = dashboard_preview.parse_scrape(httpx.get(srv.url + "/metrics").text)
    scrapes = dashboard_preview.Scrapes([0.0, 1.0], [first, second], rate_window_s=2.0)
    dashboard = json.loads(DASHBOARD.read_text())
    num_checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            vector = dashboard_preview.Evaluator(scrapes, 1).evaluate(target["expr"])
            if set(METRIC_NAME.findall(target["expr"])) & GPU_METRIC_NAMES:
                assert vector == {}
                continue
            assert vector, (panel["title"], target["expr"])
            assert all(math.isfinite(v) for v in vector.values()), (target["expr"], vector)
            num_checked += 1
    assert num_checked >= 20
    out = tmp_path / "preview.png"
    dashboard_preview.render(scrapes, dashboard, out, "test")
    assert out.stat().st_size > 0


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {(("le", "1.0"),): 2.0, (("le", "2.0"),): 4.0, (("le", "+Inf"),): 4.0}
    assert dashboard_preview._histogram_quantile(0.5, buckets) == {(): pytest.approx(1.0)}
    assert dashboard_preview._histogram_quantile(0.75, buckets) == {(): pytest.approx(1.5)}
    overflow = {(("le", "1.0"),): 1.0, (("le", "+Inf"),): 4.0}
    assert dashboard_preview._histogram_quantile(0.9, overflow) == {(): 1.0}  # highest bound


def test_monitoring_stack_is_consistent():
    """docker-compose, Prometheus and Grafana provisioning point at each other and the dashboard."""
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"minisgl", "prometheus", "grafana"} <= services.keys()
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    host, port = job["static_configs"][0]["targets"][0].split(":")
    assert host == "minisgl" and f"{port}:{port}" in services["minisgl"]["ports"]
    image_command = json.loads((ROOT / "Dockerfile").read_text().split("CMD", 1)[1])
    assert image_command[image_command.index("--port") + 1] == port
    provisioning = MONITORING / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "minisgl.yml").read_text())[
        "providers"
    ]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_trace_file_is_reproducible_and_multi_turn(tmp_path):
    lines = make_trace.generate(make_trace.TraceConfig(), seed=0)
    bundled = [json.loads(line) for line in bench_qwen.DEFAULT_TRACE.read_text().splitlines()]
    assert [vars(line) for line in lines] == bundled  # the shipped file is seed 0's output
    by_id = {r["chat_id"]: r for r in bundled}
    timestamps = [r["timestamp"] for r in bundled]
    assert timestamps == sorted(timestamps)
    children = [r for r in bundled if r["parent_chat_id"] != -1]
    assert len(children) >= len(bundled) // 3
    for child in children:
        parent = by_id[child["parent_chat_id"]]
        assert parent["timestamp"] < child["timestamp"] and child["turn"] == parent["turn"] + 1
        assert child["hash_ids"][: len(parent["hash_ids"])] == parent["hash_ids"]
    for record in bundled:
        blocks = len(record["hash_ids"])
        size = bench_qwen.BLOCK_SIZE_TOKENS
        assert (blocks - 1) * size < record["input_length"] <= blocks * size


def test_prompts_share_exactly_the_shared_blocks():
    records = bench_qwen.load_trace(bench_qwen.DEFAULT_TRACE, None)
    prompts = bench_qwen.BlockPrompts(0, bench_qwen.DEFAULT_TOKEN_ID_RANGE)
    built = {r.chat_id: prompts.prompt(r) for r in records}
    size = bench_qwen.BLOCK_SIZE_TOKENS
    for r in records:
        assert len(built[r.chat_id]) == r.input_length
        low, high = bench_qwen.DEFAULT_TOKEN_ID_RANGE
        assert all(low <= t < high for t in built[r.chat_id])
    first, second = records[0], records[1]
    num_shared = 0
    while first.hash_ids[num_shared] == second.hash_ids[num_shared]:
        num_shared += 1
    assert num_shared > 0  # the bundled trace's first two requests share a system prompt
    a, b = built[first.chat_id], built[second.chat_id]
    shared_len = num_shared * size
    assert a[:shared_len] == b[:shared_len]
    assert a[shared_len : shared_len + size] != b[shared_len : shared_len + size]
    other_seed = bench_qwen.BlockPrompts(1, bench_qwen.DEFAULT_TOKEN_ID_RANGE).prompt(first)
    assert other_seed[:size] != a[:size]


def test_wire_format_and_percentiles():
    import statistics

    spec = bench_common.RequestSpec("hello", 7)
    chat = bench_common.build_payload(spec, "m", "chat", ignore_eos=True, temperature=0.0)
    assert chat["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert chat["max_completion_tokens"] == 7 and chat["ignore_eos"] is True
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    text = bench_common.build_payload(spec, "m", "completions", ignore_eos=False, temperature=0.0)
    assert text["prompt"] == "hello" and text["max_tokens"] == 7 and "ignore_eos" not in text
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    expected = statistics.quantiles(values, n=100, method="inclusive")
    for q in (50, 90, 99):
        assert bench_common.percentile(values, q) == pytest.approx(expected[q - 1])
    assert math.isnan(bench_common.percentile([], 50))
