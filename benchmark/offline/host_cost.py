"""The host's cost of one more running request per decode step.

On a model whose forward is nearly free (one layer, 64 wide, a 512-token vocabulary), a decode
step's time is mostly the scheduler's and engine's own Python and torch calls. This script keeps
B requests decoding (the same prompt length for all, as benchmark workloads send; chunked
prefill admits them over several steps, so at 256 about one in 16 crosses a page each step) and
times whole `Scheduler.step()` calls for each B. The time inside the compute kernels (the CPU
decode stack and the sampling kernel: on a GPU, the device's share) is timed apart; the rest is
the host's. The marginal cost is the slope between the smallest and largest B:

    python scripts/make_random_checkpoint.py /tmp/host-cost --preset host-probe \\
        --vocab-size 512 --dtype float32
    python benchmark/offline/host_cost.py --model /tmp/host-cost --batch-sizes 16 256

--profile adds a cProfile of the largest B's window: the functions with the most own time, and
how many torch calls a step makes per running request (zero when nothing on the decode path is
per request).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Req, next_request_id
from minisgl.kernels.cpu_ops import CpuKernels

US_PER_S = 1e6
TOP_FUNCTIONS = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 256])
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=8, help="decode steps before timing")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--overlap", choices=["on", "off"], default="off")
    p.add_argument("--profile", action="store_true", help="cProfile the largest batch's window")
    # One kernel thread keeps the kernels' time steady on a shared machine (it is subtracted).
    p.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    return p.parse_args(argv)


KERNELS = ("decode_layers", "linear", "sample")  # CpuKernels' compute on the decode path
kernel_s = [0.0]  # seconds inside them since the last reset


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            kernel_s[0] += time.perf_counter() - start

    return wrapper


def decode_window(
    llm: LLM, batch_size: int, args: argparse.Namespace, profiler: cProfile.Profile | None
) -> tuple[list[float], float]:
    """Seconds of each of `args.steps` steps while `batch_size` requests decode, and the
    seconds of those steps spent in the compute kernels. With a profiler, `args.steps` more
    steps run under it afterwards (not timed)."""
    scheduler = llm.scheduler
    rng = random.Random(batch_size)
    vocab = scheduler.limits.vocab_size
    params = SamplingParams(
        max_tokens=args.warmup_steps + 2 * args.steps + 64, temperature=0.0, ignore_eos=True
    )
    reqs = [
        Req(next_request_id(), [rng.randrange(1, vocab) for _ in range(args.prompt_len)], params)
        for _ in range(batch_size)
    ]
    for req in reqs:
        scheduler.add_request(req)
    bound = 10 * (batch_size + args.warmup_steps + 2 * args.steps)  # steps; prefill is chunked
    for _ in range(bound):  # until every request is decoding, then the warm-up steps
        scheduler.step()
        if all(len(r.output_ids) >= args.warmup_steps for r in reqs):
            break
    assert len(scheduler.running) == batch_size, "not all requests run at once: more pages?"
    times = []
    kernel_s[0] = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - start)
    in_kernels_s = kernel_s[0]
    if profiler is not None:
        profiler.enable()
        for _ in range(args.steps):
            scheduler.step()
        profiler.disable()
    assert len(scheduler.running) == batch_size, "a request finished inside the window"
    for _ in range(bound):
        if not scheduler.has_work():
            break
        scheduler.step()
    scheduler.flush_cache()
    return times, in_kernels_s


def torch_calls(stats: pstats.Stats) -> int:
    """Calls into torch's C functions (`torch.tensor`, tensor methods, ops) in the profile."""
    total = 0
    for (filename, _, name), (_, num_calls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~" and ("torch" in name or "Tensor" in name):
            total += num_calls
    return total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in KERNELS:
        setattr(CpuKernels, name, timed(getattr(CpuKernels, name)))
    sizes = sorted(args.batch_sizes)
    llm = LLM(
        model=args.model,
        page_size=args.page_size,
        max_running_requests=max(sizes),
        overlap=args.overlap,
        dtype="float32",
    )
    try:
        llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        llm.scheduler.flush_cache()
        rows = []
        torch_calls_per_step: list[float] = []
        profiler = None
        for size in sizes:
            profiler = cProfile.Profile() if args.profile else None
            times, in_kernels_s = decode_window(llm, size, args, profiler)
            mean_s = statistics.mean(times)
            rows.append((size, mean_s, max(times), mean_s - in_kernels_s / len(times)))
            if profiler is not None:
                torch_calls_per_step.append(torch_calls(pstats.Stats(profiler)) / args.steps)
    finally:
        llm.shutdown()
    print(
        f"\nprompt {args.prompt_len} tokens, page {args.page_size}, overlap {args.overlap}, "
        f"{args.threads} thread(s)"
    )
    print(f"{'running':>8} {'ms/step':>9} {'max':>9} {'kernels':>9} {'host':>9}")
    for size, mean_s, max_s, host_s in rows:
        ms = [x * 1e3 for x in (mean_s, max_s, mean_s - host_s, host_s)]
        print(f"{size:>8} " + " ".join(f"{x:9.3f}" for x in ms))
    (small, small_s, _, small_host_s), (large, large_s, _, large_host_s) = rows[0], rows[-1]
    if large > small:
        per_req = US_PER_S / (large - small)
        print(
            f"marginal cost per running request per step: {(large_s - small_s) * per_req:.2f} us "
            f"in all, {(large_host_s - small_host_s) * per_req:.2f} us on the host"
        )
    if profiler is not None:
        # Per running request: the slope of torch calls per step between the batch sizes
        # (0 when nothing on the decode path is done per request).
        calls = ", ".join(
            f"{n:.0f} at {size}" for n, size in zip(torch_calls_per_step, sizes, strict=True)
        )
        print(f"\ntorch calls per step: {calls}")
        if large > small:
            slope = (torch_calls_per_step[-1] - torch_calls_per_step[0]) / (large - small)
            print(f"torch calls per running request per step: {slope:.3f}")
        print(f"cProfile of {large} running, {args.steps} steps:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(TOP_FUNCTIONS)


if __name__ == "__main__":
    main()
