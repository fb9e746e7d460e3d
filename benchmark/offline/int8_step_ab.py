"""int8 against fp32 activations on one model step, alternating in one process: CPU time.

A batch-1 decode step (after a --context-len-token prompt) and the prefill of a fresh
--prefill-tokens-token prompt (its chunks as the scheduler cuts them), each captured once and
replayed --steps times per path, the paths alternating replay by replay (the int8 switch is
process-wide: MINISGL_INT8_ACTIVATIONS). One torch thread and its CPU time
(`time.thread_time`): steady when other processes share the cores. Prints the fastest and the
median replay per path, and fp32 / int8.

    python benchmark/offline/int8_step_ab.py --model FILE.gguf --prefill-tokens 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch  # noqa: E402
from profile_decode import first_decode_batch  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.core import Req, next_request_id  # noqa: E402
from minisgl.engine.batch import ForwardBatch  # noqa: E402
from minisgl.kernels import cpu  # noqa: E402

MS = 1e3


def prefill_batches(llm: LLM, tokens: int) -> list[ForwardBatch]:
    """The forward batches of one fresh `tokens`-token prompt's prefill (its chunks)."""
    engine = llm.scheduler.engine  # type: ignore[attr-defined]
    vocab = engine.model_config.vocab_size
    prompt = [(7919 * j + 29) % vocab for j in range(tokens)]
    llm.scheduler.add_request(Req(next_request_id(), prompt, SamplingParams(max_tokens=2)))
    captured: list[ForwardBatch] = []
    forward = engine.forward

    def spy(batch: ForwardBatch, *rest: Any) -> Any:
        if not batch.is_decode:
            captured.append(batch)
        return forward(batch, *rest)

    engine.forward = spy
    try:
        while sum(sum(b.extend_lens) for b in captured) < tokens:
            llm.scheduler.step()
    finally:
        engine.forward = forward
    return captured


def replay(engine: Any, batches: list[ForwardBatch]) -> float:
    start = time.thread_time()
    for batch in batches:
        engine.forward(batch).result()
    return time.thread_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    p.add_argument("--context-len", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--steps", type=int, default=10, help="replays per path")
    args = p.parse_args()
    torch.set_num_threads(1)
    kernels = cpu.get()
    assert kernels is not None and kernels.set_int8_activations(True), "no int8 path here"
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    with LLM(args.model, page_size=16) as llm:
        engine = llm.scheduler.engine  # type: ignore[attr-defined]
        shapes = {
            f"prefill {args.prefill_tokens} tokens": prefill_batches(llm, args.prefill_tokens)
        }
        shapes["decode batch 1"] = [first_decode_batch(llm, 1, args.context_len)]
        for shape, batches in shapes.items():
            for i in range(2 * args.steps + 2):  # the first replay of each path warms up
                path = ("fp32", "int8")[i % 2]
                kernels.set_int8_activations(path == "int8")
                seconds = replay(engine, batches)
                if i >= 2:
                    times[shape, path].append(seconds)
    for shape, batches in shapes.items():
        fp32, int8 = times[shape, "fp32"], times[shape, "int8"]
        chunks = "+".join(str(sum(b.extend_lens)) for b in batches)
        print(
            f"{shape} ({chunks}): fp32 best {min(fp32) * MS:.1f} ms, median"
            f" {statistics.median(fp32) * MS:.1f}; int8 best {min(int8) * MS:.1f}, median"
            f" {statistics.median(int8) * MS:.1f}; fp32 / int8 best"
            f" {min(fp32) / min(int8):.2f}x, median"
            f" {statistics.median(fp32) / statistics.median(int8):.2f}x"
        )
    print(f"one thread, CPU time; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
