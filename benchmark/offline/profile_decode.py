"""Where the milliseconds of one CPU decode step go, at several batch sizes.

For each batch size, `batch_size` requests with `--context-len`-token prompts are prefilled, then
one decode-only step is replayed `--steps` times (each replay recomputes the same token at the
same position, so the KV length stays fixed). The fused decode stack times each of its ops in C
(minisgl/kernels: `mg_decode_layers`, summed over layers); embedding, the final norm and LM head,
sampling and the rest of `Engine.forward` are timed around their Python calls. The table shows
the fastest replay's breakdown (other load on the machine only adds time) and the median step.

    python benchmark/offline/profile_decode.py --batch-sizes 1,16,64 --context-len 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# Before torch loads libgomp: passive OpenMP waits, as `import minisgl` sets (see its __init__).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from minisgl import LLM, SamplingParams
from minisgl.core import Req, next_request_id
from minisgl.engine.batch import ForwardBatch
from minisgl.kernels.cpu_abi import DECODE_OPS

MS = 1e3
# tokens each request may still decode: the replays recompute one step, so a few suffice (the
# KV pool of a large model may not hold max_model_len tokens per request)
MAX_NEW_TOKENS = 16
# wall time, or with --threads 1 this thread's CPU time (exact when other processes share the
# cores; the fused stack's op timers switch the same way)
clock: Callable[[], float] = time.perf_counter


def _timed(table: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += clock() - start

    return wrapper


def first_decode_batch(llm: LLM, batch_size: int, context_len: int) -> ForwardBatch:
    engine = llm.scheduler.engine  # type: ignore[attr-defined]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i in range(batch_size):
        prompt = [(7919 * (i * context_len + j) + 13) % vocab for j in range(context_len)]
        llm.scheduler.add_request(Req(next_request_id(), prompt, params))
    captured: list[ForwardBatch] = []
    forward = engine.forward

    def spy(batch: ForwardBatch, *rest: Any) -> Any:  # rest: the vocab mask, if any
        if batch.is_decode and batch.num_seqs == batch_size:
            captured.append(batch)
        return forward(batch, *rest)

    engine.forward = spy
    try:
        while not captured:
            llm.scheduler.step()
    finally:
        engine.forward = forward
    return captured[0]


def profile(llm: LLM, batch_size: int, context_len: int, steps: int) -> dict[str, float]:
    """Milliseconds per op of the fastest replayed step, plus 'median step' and 'step'."""
    engine = llm.scheduler.engine  # type: ignore[attr-defined]
    model, stack = engine.model, engine.model.cpu_decode_stack
    if stack is None:
        raise SystemExit("the fused CPU decode stack is off here (MoE, tp > 1, or no kernels)")
    batch = first_decode_batch(llm, batch_size, context_len)
    outside: dict[str, float] = defaultdict(float)
    model.model.embed_tokens.forward = _timed(
        outside, "embedding", model.model.embed_tokens.forward
    )
    model.model.norm.forward = _timed(outside, "final norm", model.model.norm.forward)
    model.lm_head.compute_logits = _timed(outside, "lm_head", model.lm_head.compute_logits)
    engine._sample = _timed(outside, "sampling", engine._sample)
    stack.op_seconds = torch.zeros(len(DECODE_OPS), dtype=torch.float64)
    best: dict[str, float] | None = None
    totals = []
    for _ in range(steps + 1):  # the first replay warms up
        stack.op_seconds.zero_()
        outside.clear()
        start = clock()
        engine.forward(batch).result()
        total = clock() - start
        totals.append(total)
        row = {name: float(s) * MS for name, s in zip(DECODE_OPS, stack.op_seconds, strict=True)}
        row.update({name: s * MS for name, s in outside.items()})
        row["step"] = total * MS
        row["other (batch metadata, Python)"] = total * MS - sum(
            v for k, v in row.items() if k != "step"
        )
        if best is None or row["step"] < best["step"]:
            best = row
    assert best is not None
    best["median step"] = statistics.median(totals[1:]) * MS
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, bf16, fp16, fp8_e4m3, ...")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool (default: minisgl's)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's); with one, times are the thread's CPU time, exact "
        "even when other processes share the cores (with several, wall time: a preempted "
        "thread's work can be booked to the op after it)",
    )
    args = p.parse_args()
    global clock
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        clock = time.thread_time if args.threads == 1 else clock
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    rows = {}
    for size in sizes:
        kv = dict(kv_cache_dtype=args.kv_cache_dtype, kv_cache_gb=args.kv_cache_gb)
        with LLM(args.model, max_running_requests=max(sizes), page_size=16, **kv) as llm:
            rows[size] = profile(llm, size, args.context_len, args.steps)
    names = [n for n in rows[sizes[0]] if n not in ("step", "median step")]
    print(
        f"\nms per decode step, context {args.context_len} tokens, {args.kv_cache_dtype} KV, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )
    print("| op | " + " | ".join(f"batch {s}" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{rows[s].get(name, 0.0):.2f}" for s in sizes) + " |")
    for name in ("step", "median step"):
        print(f"| **{name}** | " + " | ".join(f"**{rows[s][name]:.2f}**" for s in sizes) + " |")
    print(
        "| tok/s (fastest step) | "
        + " | ".join(f"{s / rows[s]['step'] * MS:.1f}" for s in sizes)
        + " |"
    )


if __name__ == "__main__":
    main()
