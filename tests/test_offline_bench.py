"""The offline benchmark, the step profiler and the CPU speed tools, run as their users run
them (subprocesses, a tiny random model, a few seconds each): the workload's token counts come
out exact (ignore_eos), and the profiler reports the window it was asked for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "benchmark" / "offline"
TIMEOUT_S = 300
NUM_REQUESTS = 6
WORKLOAD = (
    f"--num-requests={NUM_REQUESTS}",
    "--min-input-len=8",
    "--max-input-len=24",
    "--min-output-len=12",
    "--max-output-len=12",
    "--page-size=1",
    "--num-pages=2048",
)


SAMPLING_SETTINGS = [
    "greedy",
    "temperature 0.8",
    "Qwen3 (t 0.6, top-k 20, top-p 0.95)",
    "top-p 0.9",
    "min-p 0.05",
    "penalties (rep 1.1, freq 0.5, pres 0.5)",
]


def run_script(script: str, model: Path, *args: str, workload: tuple[str, ...] = WORKLOAD) -> str:
    command = [sys.executable, str(OFFLINE / script), f"--model={model}", *workload, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def rate_bounds(num_tokens: int, seconds_text: str) -> tuple[float, float]:
    """The tokens-per-second a run may print given its time printed with 2 decimals (and
    the rate itself rounded to 1 decimal or to an integer: half a unit either side)."""
    seconds = float(seconds_text)
    return num_tokens / (seconds + 0.005) - 0.5, num_tokens / max(seconds - 0.005, 1e-9) + 0.5


def test_bench_counts_every_output_token(tiny_qwen3):
    out = run_script("bench.py", tiny_qwen3)
    # "workload random: 6 requests, <in> input tokens, 72 output tokens"
    workload = re.search(r"workload random: (\d+) requests, (\d+) input tokens, (\d+) output", out)
    # "minisgl radix ...: 6 reqs, <in> in + 72 out tokens in <s> s (CPU ..) | output <r> tok/s
    # | total <r> tok/s | ... | prefix-cache hit <h>%"
    result = re.search(
        r": (\d+) reqs, (\d+) in \+ (\d+) out tokens in ([\d.]+) s .*\| output ([\d.]+) tok/s"
        r" \| total ([\d.]+) tok/s .*\| prefix-cache hit ([\d.]+)%",
        out,
    )
    computed = re.search(r"prefill computed (\d+) tokens, retractions (\d+)", out)
    assert workload and result and computed, out
    num_in, num_out = int(result[2]), int(result[3])
    assert int(workload[1]) == int(result[1]) == NUM_REQUESTS
    # 6 prompts of 8 to 24 tokens; ignore_eos: exactly 12 tokens out of each
    assert NUM_REQUESTS * 8 <= num_in <= NUM_REQUESTS * 24 and num_in == int(workload[2])
    assert num_out == int(workload[3]) == NUM_REQUESTS * 12
    # The scheduler's own count of prompt tokens it computed: all of them (random prompts
    # share no prefix, so nothing comes from the cache), and nothing was retracted
    assert int(computed[1]) == num_in and int(computed[2]) == 0
    assert float(result[7]) == 0.0
    low, high = rate_bounds(num_out, result[4])
    assert low <= float(result[5]) <= high, out
    low, high = rate_bounds(num_in + num_out, result[4])
    assert low <= float(result[6]) <= high, out


def test_profile_steps_reports_its_window(tiny_qwen3):
    out = run_script("profile_steps.py", tiny_qwen3, "--skip-steps=2", "--steps=5")
    match = re.search(r"(\d+) steps in ([\d.]+) s", out)
    assert match and int(match[1]) == 5, out
    # Prefill is done after two steps (6 short prompts fit one chunk): every step decodes all 6.
    per_step = re.search(r"([\d.]+) output tokens per step", out)
    assert per_step and float(per_step[1]) == NUM_REQUESTS, out
    assert "top 15 host ops" in out
    for phase in ("schedule", "forward", "sample", "process"):  # ranges on CPU too
        assert re.search(rf"^\s+{phase}\s+[\d.]+\s+x\d+$", out, re.MULTILINE), out
    ops = re.findall(r"^\s+[\d.]+\s+[\d.]+\s+(aten::\S+)", out, re.MULTILINE)
    assert ops, out  # the forward's ops were recorded


def test_host_cost_has_no_per_request_torch_call(tiny_qwen3):
    """host_cost.py's figures add up (host = step - kernels), and between 2 and 12 running
    requests the torch calls per decode step stay flat: nothing on the decode path (page
    reservation, table writes, batch metadata, sampling) makes a torch call per request. Page
    size 4 makes requests cross pages inside the window."""
    args = ("--batch-sizes", "2", "12", "--prompt-len=9", "--steps=12", "--warmup-steps=2")
    out = run_script("host_cost.py", tiny_qwen3, "--page-size=4", "--profile", *args, workload=())
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [2, 12], out
    for _, step_ms, max_ms, kernels_ms, host_ms in rows:
        assert float(max_ms) >= float(step_ms) > 0
        assert abs(float(kernels_ms) + float(host_ms) - float(step_ms)) <= 0.02, out
    calls = re.search(r"torch calls per step: (\d+) at 2, (\d+) at 12", out)
    slope = re.search(r"torch calls per running request per step: ([\d.-]+)", out)
    assert calls and slope and "marginal cost per running request per step" in out, out
    # Before the batched reservation this was ~1.25 (a tensor or two per request, more at a
    # page crossing); a call per request per step would make it >= 1.
    assert float(slope[1]) < 0.5, out


def test_sampling_benchmark_runs():
    script = ROOT / "benchmark" / "kernels" / "bench_sampling.py"
    command = [sys.executable, str(script), "--rows", "1", "3", "--iters", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "ms per batch (mean of 1)" in done.stdout, done.stdout
    assert re.search(r"^setting\s+1 rows\s+3 rows$", done.stdout, re.MULTILINE), done.stdout
    rows = re.findall(r"^(.+?)\s+(\d+\.\d\d)\s+(\d+\.\d\d)$", done.stdout, re.MULTILINE)
    # one line per setting the script names, each with a time per batch for 1 and 3 rows
    assert [name for name, _, _ in rows] == SAMPLING_SETTINGS, done.stdout


def test_penalties_benchmark_runs(tiny_qwen3):
    script = OFFLINE / "bench_penalties.py"
    command = [sys.executable, str(script), str(tiny_qwen3)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rates = re.findall(r"^(plain|penalties)\s+([\d.]+) s\s+(\d+) output tok/s$", done.stdout, re.M)
    assert [name for name, _, _ in rates] == ["plain", "penalties"], done.stdout
    for _, seconds, rate in rates:  # 64 requests x 64 tokens, over the time it printed
        low, high = rate_bounds(64 * 64, seconds)
        assert low <= int(rate) <= high, done.stdout


def test_profile_steps_refuses_a_matrix(tiny_qwen3):
    command = [sys.executable, str(OFFLINE / "profile_steps.py"), f"--model={tiny_qwen3}"]
    done = subprocess.run(
        [*command, "--gpu-matrix"], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT
    )
    assert done.returncode != 0 and "one engine config" in done.stderr


# The CPU speed tools (smoke: they follow the engine's API).


def test_profile_decode_prints_its_table(tiny_qwen3):
    args = ("--batch-sizes", "1,2", "--context-len", "8", "--steps", "2")
    assert "| **step** |" in run_script("profile_decode.py", tiny_qwen3, *args, workload=())


def test_int8_step_ab_prints_both_shapes(tiny_qwen3):
    if " avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2: no int8 path to compare")
    args = ("--prefill-tokens", "20", "--context-len", "8", "--steps", "1")
    out = run_script("int8_step_ab.py", tiny_qwen3, *args, workload=())
    assert "prefill 20 tokens (20): fp32 best" in out and "decode batch 1 (1): fp32 best" in out


def test_decode_floor_prints_its_shares(tiny_qwen3):
    args = (
        "--decode-floor", "--num-requests", "3", "--min-input-len", "4", "--max-input-len", "8",
        "--min-output-len", "3", "--max-output-len", "6", "--floor-prompt-len", "4",
        "--floor-output-len", "4",
    )  # fmt: skip
    assert "% of the floor" in run_script("bench.py", tiny_qwen3, *args, workload=())


def test_speculative_benchmarks_report_drafts(tiny_qwen3):
    """bench.py counts the drafts it verified; bench_speculative.py prints its table, each
    workload with and without drafts, outputs identical (it exits 1 otherwise)."""
    spec = ("--speculative-algorithm=ngram", "--speculative-ngram-min-match=1")
    out = run_script("bench.py", tiny_qwen3, *spec)
    found = re.search(r"speculative: (\d+) verify steps, (\d+) draft tokens, (\d+) accepted", out)
    assert found and int(found[3]) <= int(found[2]), out
    out = run_script(
        "bench_speculative.py", tiny_qwen3, "--workloads", "quote", "story", "--rounds=2",
        workload=("--num-requests=1", "--concurrency=2", "--max-tokens=8", "--ngram-min-match=1"),
    )  # fmt: skip
    # (a tiny model's timings are noise: only the table's shape and the identity are checked)
    rows = re.findall(r"^(quote|story) +(\d+) +\S+ +\S+ +\S+x +[\d.]+ +yes$", out, re.M)
    assert sorted(rows) == [("quote", "1"), ("quote", "2"), ("story", "1"), ("story", "2")], out


def test_speculative_benchmark_through_servers(tiny_qwen3):
    """--server: the same table through two real servers (outputs compared as text)."""
    from tests.server_utils import free_port_block

    out = run_script(
        "bench_speculative.py", tiny_qwen3, "--server", f"--server-port={free_port_block(2)}",
        workload=("--workloads=quote", "--num-requests=1", "--concurrency=2", "--max-tokens=8",
                  "--ngram-min-match=1"),
    )  # fmt: skip
    rows = re.findall(r"^quote +(\d+) +\S+ +\S+ +\S+x +[\d.]+ +yes$", out, re.M)
    assert rows == ["1", "2"], out
