"""The offline benchmark, the step profiler and the CPU speed tools, run as their users run
them (subprocesses, a tiny random model, a few seconds each): the workload's token counts come
out exact (ignore_eos), and the profiler reports the window it was asked for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def run_script(script: str, model: Path, *args: str, workload: tuple[str, ...] = WORKLOAD) -> str:
    command = [sys.executable, str(OFFLINE / script), f"--model={model}", *workload, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def test_bench_counts_every_output_token(tiny_qwen3):
    out = run_script("bench.py", tiny_qwen3)
    # "minisgl radix ...: 6 reqs, <in> in + 72 out tokens in <s> s ..."
    match = re.search(r": (\d+) reqs, (\d+) in \+ (\d+) out tokens in ([\d.]+) s", out)
    assert match, out
    assert int(match[1]) == NUM_REQUESTS
    assert int(match[3]) == NUM_REQUESTS * 12
    assert float(match[4]) > 0


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


def test_sampling_benchmark_runs():
    script = ROOT / "benchmark" / "kernels" / "bench_sampling.py"
    command = [sys.executable, str(script), "--rows", "1", "3", "--iters", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = re.findall(r"^(.+?)\s+([\d.]+)\s+([\d.]+)$", done.stdout, re.MULTILINE)
    assert len(rows) == 6 and all(float(a) > 0 and float(b) > 0 for _, a, b in rows), done.stdout


def test_penalties_benchmark_runs(tiny_qwen3):
    script = OFFLINE / "bench_penalties.py"
    command = [sys.executable, str(script), str(tiny_qwen3)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rates = re.findall(r"^(plain|penalties)\s+[\d.]+ s\s+(\d+) output tok/s$", done.stdout, re.M)
    assert [name for name, _ in rates] == ["plain", "penalties"], done.stdout
    assert all(int(rate) > 0 for _, rate in rates)


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


def test_decode_floor_prints_its_shares(tiny_qwen3):
    args = (
        "--decode-floor", "--num-requests", "3", "--min-input-len", "4", "--max-input-len", "8",
        "--min-output-len", "3", "--max-output-len", "6", "--floor-prompt-len", "4",
        "--floor-output-len", "4",
    )  # fmt: skip
    assert "% of the floor" in run_script("bench.py", tiny_qwen3, *args, workload=())
