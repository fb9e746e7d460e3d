"""Offline throughput with and without sampling penalties: 64 requests of 200-token prompts,
64 greedy tokens each, on a model given by path (RESULTS.md section 13 used a tiny random Qwen3,
whose 151,936-token vocabulary makes the per-step logits work visible).

    python benchmark/offline/bench_penalties.py /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import time

from minisgl import LLM, SamplingParams

NUM_REQUESTS = 64
PROMPT_LEN = 200
OUTPUT_LEN = 64
WARMUP_REQUESTS = 4
SETTINGS = {
    "plain": {},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    args = p.parse_args()
    llm = LLM(args.model, num_pages=8192, max_running_requests=NUM_REQUESTS)
    prompts = [list(range(100 + i, 100 + i + PROMPT_LEN)) for i in range(NUM_REQUESTS)]
    try:
        for name, penalties in SETTINGS.items():
            sp = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True, **penalties)
            llm.generate(prompts[:WARMUP_REQUESTS], sp)
            start_s = time.perf_counter()
            llm.generate(prompts, sp)
            elapsed_s = time.perf_counter() - start_s
            tok_per_s = NUM_REQUESTS * OUTPUT_LEN / elapsed_s
            print(f"{name:<10} {elapsed_s:6.2f} s  {tok_per_s:7.0f} output tok/s")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
