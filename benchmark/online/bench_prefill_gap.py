"""Does a long prompt's prefill stall the streams already decoding? (issue 45, item 3)

Against a server started here with each set of `--flags` in turn: a canary streams (a short
prompt, ignore_eos); after `--quiet-chunks` of its chunks a long prompt of `--prompt-len` random
token ids (max_tokens 1) is sent. Printed per set: the canary's median gap between chunks before
the long prompt (quiet), its largest gap while the long prompt prefills (send to first token), the
target 2x quiet + 250 ms, and the long prompt's time to first token with the canary beside it and,
before the canary starts, alone (a prompt of the same length, other token ids: no cache hit).

    python benchmark/online/bench_prefill_gap.py --flags "--target-itl-ms 0" --flags ""
    python benchmark/online/bench_prefill_gap.py --model /tmp/qwen3-0.6b --prompt-len 2048 \
        --flags "--kv-cache-gb 2 --target-itl-ms 0" --flags "--kv-cache-gb 2"
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shlex
import statistics
import time
from typing import Any

from bench_common import COMPLETIONS_PATH, LocalServer, make_client, send_request

REQUEST_TIMEOUT_S = 3600.0
PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH = 1000, 20000  # ordinary tokens of both vocabularies
CANARY_PROMPT_LEN = 16
TARGET_GAP_FACTOR, TARGET_GAP_EXTRA_S = 2.0, 0.25  # the bound on the largest gap


def body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH) for _ in range(length)]


async def canary(client: Any, url: str, max_tokens: int, times_s: list[float]) -> None:
    """Stream until cancelled, appending each chunk's arrival time."""
    ids = prompt(random.Random(0), CANARY_PROMPT_LEN)
    async with client.stream("POST", url, json=body(ids, max_tokens)) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times_s.append(time.perf_counter())


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    url += COMPLETIONS_PATH
    rng = random.Random(args.seed)
    async with make_client(None, REQUEST_TIMEOUT_S) as client:
        await send_request(client, url, body(prompt(rng, 8), 4), 4)  # warm-up
        alone = await send_request(client, url, body(prompt(rng, args.prompt_len), 1), 1)
        times_s: list[float] = []
        max_tokens = args.max_model_len - CANARY_PROMPT_LEN
        streaming = asyncio.ensure_future(canary(client, url, max_tokens, times_s))
        while len(times_s) < args.quiet_chunks and not streaming.done():
            await asyncio.sleep(0.05)
        quiet_s = statistics.median(b - a for a, b in itertools.pairwise(times_s))
        sent_s = time.perf_counter()
        long = await send_request(client, url, body(prompt(rng, args.prompt_len), 1), 1)
        first_token_s = sent_s + long.ttft_s
        num_seen = len(times_s)
        while len(times_s) == num_seen and not streaming.done():  # the gap that spans the end
            await asyncio.sleep(0.05)
        streaming.cancel()
    during = [b - a for a, b in itertools.pairwise(times_s) if b > sent_s and a < first_token_s]
    return {
        "quiet_median_gap_s": quiet_s,
        "max_gap_during_prefill_s": max(during),
        "target_s": TARGET_GAP_FACTOR * quiet_s + TARGET_GAP_EXTRA_S,
        "ttft_with_canary_s": long.ttft_s,
        "ttft_alone_s": alone.ttft_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=8192, help="the canary's room too")
    parser.add_argument("--quiet-chunks", type=int, default=40)
    parser.add_argument("--flags", action="append", help="server flags, one set per run")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for flags in args.flags or [""]:
        extra = [f"--max-model-len={args.max_model_len}", *shlex.split(flags)]
        srv = LocalServer(args.model, args.port, extra)
        try:
            figures = asyncio.run(measure(srv.url, args))
        finally:
            srv.stop()
        print(f"flags {flags!r}, prompt {args.prompt_len} tokens:", flush=True)
        for name, value in figures.items():
            print(f"  {name:26s} {value:8.3f}", flush=True)


if __name__ == "__main__":
    main()
