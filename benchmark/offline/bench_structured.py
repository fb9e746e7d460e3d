"""Structured-output cost: constrained vs unconstrained decoding on the same workload.

B requests decode OUT tokens each, greedy, ignore_eos, on the same token-id prompts, twice:
without a constraint, and under a JSON schema that keeps every step constrained for the whole
run (an array of at least OUT integers, so the grammar never completes). The difference is what
structured outputs cost: building each step's bitmask from the matchers, masking the logits,
and advancing the matchers. Runs alternate (plain, constrained, plain, ...) and the fastest of
each is kept, to damp the noise of a shared machine.

    python benchmark/offline/bench_structured.py                     # batch 16, SmolLM2, CPU
    python benchmark/offline/bench_structured.py --overlap on        # the overlap order (b)
"""

from __future__ import annotations

import argparse
import json
import random
import time

from minisgl import LLM, SamplingParams
from minisgl.core import Constraint

PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH = 1000, 20000  # ordinary tokens of the bundled vocabulary


def schema(num_items: int) -> str:
    item = {"type": "integer", "minimum": 0, "maximum": 999}
    return json.dumps({"type": "array", "items": item, "minItems": num_items})


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start_s = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed_s = time.perf_counter() - start_s
    return elapsed_s, sum(len(o.token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()

    rng = random.Random(0)
    prompts = [
        [rng.randrange(PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH) for _ in range(args.input_len)]
        for _ in range(args.batch_size)
    ]
    base = dict(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constraint = Constraint("json_schema", schema(args.output_len))
    runs = {
        "unconstrained": SamplingParams(**base),
        "json schema": SamplingParams(**base, constraint=constraint),
    }
    with LLM(
        args.model,
        page_size=args.page_size,
        overlap=args.overlap,
        max_running_requests=max(args.batch_size, 16),
        cache_type="naive",  # every run computes its prompts: no radix hits between runs
    ) as llm:
        for params in runs.values():  # warm-up: compiles the grammar, touches every code path
            llm.generate(prompts[:2], SamplingParams(**{**base, "max_tokens": 4}))
            llm.generate(prompts[:2], params)
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.repeat):
            for name, params in runs.items():
                elapsed_s, tokens = timed(llm, prompts, params)
                print(f"{name}: {elapsed_s:.2f} s, {tokens} tokens", flush=True)
                if name not in best or elapsed_s < best[name][0]:
                    best[name] = (elapsed_s, tokens)
    print(
        f"batch {args.batch_size}, input {args.input_len}, output {args.output_len} tokens, "
        f"overlap {args.overlap}, fastest of {args.repeat}"
    )
    print("| run | time s | out tok/s | cost |")
    print("|---|---:|---:|---:|")
    plain_s = best["unconstrained"][0]
    for name, (elapsed_s, tokens) in best.items():
        cost = f"{(elapsed_s / plain_s - 1) * 100:+.1f}%" if name != "unconstrained" else ""
        print(f"| {name} | {elapsed_s:.2f} | {tokens / elapsed_s:.1f} | {cost} |")


if __name__ == "__main__":
    main()
