"""Where the time of a run's steady state goes: host phases, GPU kernels, and the gaps between.

It runs bench.py's workload (same flags) on one engine config, lets the first --skip-steps
scheduler steps pass (the prompts' prefill), then records --steps steps under torch.profiler and
prints:
- the window's wall time per step, tokens per step, and output tok/s;
- host time per step in each phase the scheduler and engine mark (schedule, forward, sample,
  process: NVTX and torch.profiler ranges);
- GPU kernel time per step and the share of the window the GPU was busy: well under 100% means
  the host (Python, launches, synchronisation) is what bounds the run, not the GPU;
- the kernels and host ops that take the most time.

    python benchmark/offline/profile_steps.py --model /tmp/qwen3-0.6b --num-requests 256 \\
        --min-input-len 100 --max-input-len 1024 --min-output-len 100 --max-output-len 1024 \\
        --attention-backend flashinfer --overlap on --cuda-graphs on

Every flag bench.py takes (workload and engine options) is accepted; --gpu-matrix, --compare and
--hf are not (one config per run). Add --trace FILE for a Chrome/Perfetto trace of the window.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench import (  # noqa: E402
    Workload,
    build_workload,
    configs_to_run,
    engine_options,
    warm_up,
    workload_requests,
)

from minisgl import LLM  # noqa: E402
from minisgl.engine import device  # noqa: E402
from minisgl.engine.engine import resolve_device  # noqa: E402

PHASES = ("schedule", "forward", "sample", "process")
TOP_KERNELS = 12
TOP_HOST_OPS = 15
US_PER_MS = 1e3


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--skip-steps", type=int, default=40, help="steps before the window")
    p.add_argument("--steps", type=int, default=50, help="steps in the profiled window")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the window here")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    own, rest = parse_args(argv)
    args = bench.parse_args(rest)
    if args.gpu_matrix or args.compare or args.hf:
        sys.exit("profile_steps.py runs one engine config: drop --gpu-matrix, --compare, --hf")
    workload = build_workload(args)
    (config,) = configs_to_run(args)
    device.RANGES_ON_CPU = True  # the phases' ranges (always on for CUDA)
    llm = LLM(model=args.model, **engine_options(args, config))
    try:
        warm_up(llm)
        report(llm, workload, own, config.label)
    finally:
        llm.shutdown()


def report(llm: LLM, workload: Workload, own: argparse.Namespace, label: str) -> None:
    on_cuda = resolve_device(llm.args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    scheduler = llm.scheduler
    reqs = workload_requests(workload)
    for req in reqs:
        scheduler.add_request(req)
    pending = {req.rid for req in reqs}

    def step() -> int:
        tokens = 0
        for out in scheduler.step():
            if out.error is not None:
                raise RuntimeError(f"{out.rid}: {out.error}")
            tokens += out.num_new_tokens
            if out.finish_reason is not None:
                pending.discard(out.rid)
        return tokens

    for _ in range(own.skip_steps):
        if not pending:
            break
        step()
    if not pending:
        sys.exit(f"the workload finished within --skip-steps {own.skip_steps}: lower it")
    num_steps = num_tokens = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while pending and num_steps < own.steps:
            num_tokens += step()
            num_steps += 1
        if on_cuda:
            torch.cuda.synchronize()
        window_s = time.perf_counter() - start
    while pending:  # let the rest finish so the engine shuts down from a clean state
        step()
    if own.trace:
        prof.export_chrome_trace(own.trace)
    print_report(prof, label, num_steps, num_tokens, window_s, on_cuda)


def print_report(
    prof: profile, label: str, num_steps: int, num_tokens: int, window_s: float, on_cuda: bool
) -> None:
    events = prof.key_averages()
    per_step_ms = window_s * US_PER_MS / num_steps
    print(f"\n== {label}: {num_steps} steps in {window_s:.3f} s (profiler on)")
    print(
        f"   {per_step_ms:.2f} ms per step, {num_tokens / num_steps:.1f} output tokens per step, "
        f"{num_tokens / window_s:.0f} output tok/s"
    )
    by_name = {e.key: e for e in events}
    phases = [(name, by_name[name]) for name in PHASES if name in by_name]
    if phases:
        # The phases are disjoint and run one after another on the scheduler's thread; the wait
        # for a batch's tokens (before `process`) is in none of them.
        print("   host time per step by phase (ms):")
        in_phases_ms = 0.0
        for name, e in phases:
            ms = e.cpu_time_total / US_PER_MS / num_steps
            in_phases_ms += ms
            print(f"     {name:<10} {ms:8.2f}  x{e.count}")
        rest_ms = per_step_ms - in_phases_ms
        print(f"     {'the rest':<10} {rest_ms:8.2f}  (mostly waiting for the device)")
    if on_cuda:
        kernels = [e for e in events if e.self_device_time_total > 0]
        kernel_ms = sum(e.self_device_time_total for e in kernels) / US_PER_MS
        busy = kernel_ms / (window_s * US_PER_MS)
        launches = sum(e.count for e in kernels) / num_steps
        print(
            f"   GPU kernel time {kernel_ms / num_steps:.2f} ms per step in {launches:.0f} "
            f"kernels: the GPU was busy {busy:.0%} of the window (the rest: waiting on the host)"
        )
        print(f"   top {TOP_KERNELS} kernels by GPU time (ms per step, calls per step):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]:
            ms = e.self_device_time_total / US_PER_MS / num_steps
            print(f"     {ms:8.3f}  {e.count / num_steps:6.1f}  {e.key[:90]}")
    host_ops = [e for e in events if e.key not in PHASES and e.self_cpu_time_total > 0]
    print(f"   top {TOP_HOST_OPS} host ops by self CPU time (ms per step, calls per step):")
    for e in sorted(host_ops, key=lambda e: -e.self_cpu_time_total)[:TOP_HOST_OPS]:
        ms = e.self_cpu_time_total / US_PER_MS / num_steps
        print(f"     {ms:8.3f}  {e.count / num_steps:6.1f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
