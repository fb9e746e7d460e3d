"""The CPU prefill-chunk attention kernel alone, and where a small chunk's step goes (issue 45).

Default: times `CpuKernels.chunk_attention` (csrc/chunk_attention.c) on chunks of the shapes
that matter (a 16-token chunk after a long prefix: what the scheduler runs beside decoding
streams; a big chunk: a prompt prefilled alone), K/V in consecutive pool slots, best of --repeats
calls, torch's thread count. Run it on two builds alternately (e.g. `git stash`) to compare them.

    python benchmark/offline/bench_chunk_attention.py
    python benchmark/offline/bench_chunk_attention.py --kv-dtype float16

`--step-breakdown PREFIX`: the bundled model offline, a prompt of PREFIX tokens prefilled, then
64 more tokens of it in 16-token chunks; prints the time per step and, per CPU kernel, its share
(each kernel call timed from Python).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# (query heads, KV heads, head dim, chunk tokens, cached prefix): the bundled SmolLM2-135M's heads
# and Qwen3-0.6B's
SHAPES = [
    (9, 3, 64, 16, 7800),
    (9, 3, 64, 16, 3000),
    (16, 8, 128, 16, 7800),
    (9, 3, 64, 256, 4000),
    (9, 3, 64, 1024, 7000),
    (16, 8, 128, 1024, 3000),
]
POOL_SLOTS = 20_000
LATE_TOKENS, LATE_CHUNK = 64, 16


def time_kernel(dtype: torch.dtype, repeats: int) -> None:
    from minisgl.kernels.cpu import get

    kernels, g = get(), torch.Generator().manual_seed(0)
    print(f"chunk attention, K/V {dtype}, {torch.get_num_threads()} threads, best of {repeats}")
    for hq, hk, head_dim, n, prefix in SHAPES:
        k_cache, v_cache = (
            torch.randn(POOL_SLOTS, hk, head_dim, generator=g).to(dtype) for _ in range(2)
        )
        slots = torch.arange(prefix + n, dtype=torch.int32)
        q = torch.randn(n, hq, head_dim, generator=g)
        out = torch.empty_like(q)
        best_s = float("inf")
        for _ in range(repeats + 1):  # (the first call warms the caches)
            start = time.perf_counter()
            kernels.chunk_attention(q, out, slots, k_cache, v_cache, head_dim**-0.5, (1.0, 1.0))
            best_s = min(best_s, time.perf_counter() - start)
        flops = 4 * n * hq * head_dim * (prefix + (n + 1) / 2)
        print(
            f"  heads {hq}/{hk} x {head_dim}, {n:4d} tokens after {prefix:4d}: "
            f"{best_s * 1e3:7.2f} ms  {flops / best_s / 1e9:5.1f} GFLOP/s"
        )


def step_breakdown(prefix_len: int) -> None:
    from minisgl import LLM, SamplingParams
    from minisgl.kernels.cpu_ops import CpuKernels

    spent_s: dict[str, float] = defaultdict(float)

    def timed(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                spent_s[name] += time.perf_counter() - start

        return run

    for name, op in list(vars(CpuKernels).items()):
        if callable(op) and not name.startswith(("_", "supports")):
            setattr(CpuKernels, name, timed(name, op))
    rng = random.Random(0)
    ids = [rng.randrange(1000, 20000) for _ in range(prefix_len + LATE_TOKENS)]
    one_token = SamplingParams(max_tokens=1)
    with LLM() as llm:
        llm.generate([ids[:prefix_len]], one_token)
        llm.scheduler.prefill.max_prefill_tokens = LATE_CHUNK  # type: ignore[attr-defined]
        spent_s.clear()
        start = time.perf_counter()
        llm.generate([ids], one_token)
        steps = LATE_TOKENS // LATE_CHUNK
        step_s = (time.perf_counter() - start) / steps
    print(f"{LATE_CHUNK}-token chunks after {prefix_len} tokens: {step_s * 1e3:.0f} ms a step")
    for name, total_s in sorted(spent_s.items(), key=lambda item: -item[1]):
        print(f"  {name:16s} {total_s / steps * 1e3:7.1f} ms")
    print(f"  {'(the rest)':16s} {(step_s - sum(spent_s.values()) / steps) * 1e3:7.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--step-breakdown", type=int, default=None, metavar="PREFIX")
    args = p.parse_args()
    if args.step_breakdown is not None:
        step_breakdown(args.step_breakdown)
    else:
        time_kernel(getattr(torch, args.kv_dtype), args.repeats)


if __name__ == "__main__":
    main()
