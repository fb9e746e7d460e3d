"""Online benchmark: many concurrent streaming clients against a running OpenAI-compatible server.

    python -m minisgl.server --port 1919 &
    python benchmark/online/bench_qwen.py --base-url http://127.0.0.1:1919 --num-requests 64

Prints request throughput, output tokens/s, and time-to-first-token / inter-token latency
percentiles. Token counts come from the final usage chunk (stream_options.include_usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = "the of and to in is was for on with as by at from that this it be are or an".split()
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str = ""


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    result = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return Result(ok=False, error=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                now = time.perf_counter()
                # The first chunk only carries the role: time the first one with text.
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    if not first:
                        first = now
                    elif last:
                        result.chunk_gaps_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Result(ok=False, error=type(exc).__name__)
    result.ok = True
    result.ttft_s = first - start if first else 0.0
    result.e2e_s = time.perf_counter() - start
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(args.concurrency)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        model = args.model
        if model is None:
            models = (await client.get(args.base_url.rstrip("/") + "/v1/models")).json()
            model = models["data"][0]["id"]

        async def bounded(prompt: str, max_tokens: int) -> Result:
            async with sem:
                return await one_request(client, url, model, prompt, max_tokens)

        jobs = [
            bounded(
                random_prompt(rng, rng.randint(args.min_input_words, args.max_input_words)),
                rng.randint(args.min_output_len, args.max_output_len),
            )
            for _ in range(args.num_requests)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    ttfts = [r.ttft_s for r in ok]
    print(f"model                 {model}")
    print(f"requests              {len(ok)} ok / {len(results)}  (concurrency {args.concurrency})")
    print(f"wall time             {elapsed:.2f} s")
    print(f"request throughput    {len(ok) / elapsed:.2f} req/s")
    print(f"output throughput     {out_tokens / elapsed:.1f} tok/s")
    print(
        f"TTFT mean / p50 / p99 {statistics.fmean(ttfts or [0]) * 1e3:.0f} / "
        f"{pct(ttfts, 0.5) * 1e3:.0f} / {pct(ttfts, 0.99) * 1e3:.0f} ms"
    )
    print(
        f"ITL  mean / p50 / p99 {statistics.fmean(gaps or [0]) * 1e3:.1f} / "
        f"{pct(gaps, 0.5) * 1e3:.1f} / {pct(gaps, 0.99) * 1e3:.1f} ms"
    )
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"errors                {sorted(set(errors))}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--min-input-words", type=int, default=16)
    p.add_argument("--max-input-words", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
