"""Who goes first: the issue-23 workloads, each against two real servers started here, the
scheduling policy off (FCFS, arrival order) and on, with --max-running-requests 2.

  priority  10 long requests of priority 0 (2 run, 8 wait), then 3 short ones of priority 10:
            their mean time to first token with --enable-priority-scheduling vs without.
            Target: at most 1/5.
  fairness  tenant A (`user`) floods 10 long requests, then tenant B sends 2 short ones: B's
            mean time to first token with --tenant-fairness vs without (target: at most 1/5).
            Then both backlogged (A first, then B, each with many requests): each tenant's
            share of the output tokens while both still wait (target: 40-60% each).
  lpm       4 shared prefixes x 8 requests, shuffled, sent at once, on a KV pool that cannot
            hold every prefix: the prefix-cache hit share with --schedule-policy lpm vs fcfs
            (target: at least 1.3x) and the wall time (target: no worse).

Prompts are token ids (/v1/completions, greedy, ignore_eos): lengths are exact. Each server
serves one warm-up request first.

    python benchmark/online/bench_policy.py                  # the bundled SmolLM2, CPU
    python benchmark/online/bench_policy.py --workloads lpm --model PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from bench_common import (
    COMPLETIONS_PATH,
    LocalServer,
    cache_counters,
    make_client,
    send_request,
)

REQUEST_TIMEOUT_S = 1800.0
POLL_S = 0.05
PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH = 1000, 20000  # ordinary tokens of the bundled vocabulary
MAX_RUNNING = 2  # the targets are stated for --max-running-requests 2
TTFT_TARGET_RATIO = 0.2
SHARE_TARGET = (0.4, 0.6)
LPM_HIT_TARGET_RATIO = 1.3

# Workload shapes: (prompt tokens, output tokens).
LONG, SHORT = (64, 96), (16, 8)
HIGH_PRIORITY = 10
NUM_LONG, NUM_SHORT_HIGH, NUM_SHORT_B = 10, 3, 2
BACKLOG_A, BACKLOG_B = (16, 64), (16, 32)  # the long run: A writes twice as much per request
NUM_BACKLOG = 16  # requests per tenant in the long run
LPM_PREFIXES, LPM_PER_PREFIX, LPM_PREFIX_LEN, LPM_SUFFIX_LEN, LPM_OUTPUT = 4, 8, 256, 16, 8
LPM_NUM_PAGES = 900  # ~3 prefixes: running requests lock two, the rest compete for the pool


@contextmanager
def server(args: argparse.Namespace, flags: list[str]) -> Iterator[LocalServer]:
    srv = LocalServer(args.model, args.port, [f"--max-running-requests={MAX_RUNNING}", *flags])
    try:
        yield srv
    finally:
        srv.stop()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(PROMPT_VOCAB_LOW, PROMPT_VOCAB_HIGH) for _ in range(length)]


def body(ids: list[int], output_len: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip


async def ttfts(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]) -> list[float]:
    results = await asyncio.gather(*(send_request(client, url, b, b["max_tokens"]) for b in bodies))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:3]}")
    return [r.ttft_s for r in results]


async def warm_up(client: httpx.AsyncClient, url: str) -> None:
    await ttfts(client, url + COMPLETIONS_PATH, [body(prompt(random.Random(1), 8), 4)])


async def wait_running(client: httpx.AsyncClient, url: str, num_running: int) -> None:
    """Until `num_running` requests run (the first wave is in flight)."""
    while True:
        load = (await client.get(url + "/get_load")).json()[0]
        if load["num_reqs"] - load["num_waiting_reqs"] >= num_running:
            return
        await asyncio.sleep(POLL_S)


async def flood_then_short(
    url: str, flood: list[dict[str, Any]], short: list[dict[str, Any]], delay_s: float
) -> float:
    """`flood` at once; once it runs (plus `delay_s`), `short`: their mean time to first token."""
    async with make_client(None, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, url)
        flooding = asyncio.ensure_future(ttfts(client, url + COMPLETIONS_PATH, flood))
        await wait_running(client, url, MAX_RUNNING)
        await asyncio.sleep(delay_s)
        mean_s = statistics.fmean(await ttfts(client, url + COMPLETIONS_PATH, short))
        await flooding
    return mean_s


def priority_workload(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    flood = [body(prompt(rng, LONG[0]), LONG[1], priority=0) for _ in range(NUM_LONG)]
    short = [body(prompt(rng, SHORT[0]), SHORT[1], priority=HIGH_PRIORITY)
             for _ in range(NUM_SHORT_HIGH)]  # fmt: skip
    figures = {}
    for mode, flags in (("fcfs", []), ("priority", ["--enable-priority-scheduling"])):
        with server(args, flags) as srv:
            figures[mode] = asyncio.run(flood_then_short(srv.url, flood, short, 0.0))
    ratio = figures["priority"] / figures["fcfs"]
    return {
        "high_priority_mean_ttft_s": figures, "ratio": ratio,
        "target": f"<= {TTFT_TARGET_RATIO}", "met": ratio <= TTFT_TARGET_RATIO,
    }  # fmt: skip


async def stream_times(client: httpx.AsyncClient, url: str, b: dict[str, Any]) -> list[float]:
    """The arrival time of each output chunk that carries text (one per token on CPU, where
    every step's detokenized output holds one token per request)."""
    times = []
    async with client.stream("POST", url, json=b) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    times.append(time.perf_counter())
    return times


async def backlogged_shares(url: str, tenants: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Every tenant's requests at once (in the order given); each tenant's share of the tokens
    streamed until the first tenant's last request ends (while all are backlogged)."""
    async with make_client(None, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, url)
        tasks = {}
        for tenant, bodies in tenants.items():
            tasks[tenant] = [
                asyncio.ensure_future(stream_times(client, url + COMPLETIONS_PATH, b))
                for b in bodies
            ]
            await asyncio.sleep(POLL_S)  # A's arrive first
        times = {t: await asyncio.gather(*ts) for t, ts in tasks.items()}
    window_end_s = min(max(max(chunks) for chunks in per) for per in times.values())
    counts = {
        t: sum(s <= window_end_s for chunks in per for s in chunks) for t, per in times.items()
    }
    total = sum(counts.values())
    return {t: n / total for t, n in counts.items()}


def fairness_workload(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    flood = [body(prompt(rng, LONG[0]), LONG[1], user="A") for _ in range(NUM_LONG)]
    short = [body(prompt(rng, SHORT[0]), SHORT[1], user="B") for _ in range(NUM_SHORT_B)]
    backlog = {
        "A": [body(prompt(rng, BACKLOG_A[0]), BACKLOG_A[1], user="A") for _ in range(NUM_BACKLOG)],
        "B": [body(prompt(rng, BACKLOG_B[0]), BACKLOG_B[1], user="B") for _ in range(NUM_BACKLOG)],
    }
    ttft, shares = {}, {}
    for mode, flags in (("fcfs", []), ("vtc", ["--tenant-fairness"])):
        with server(args, flags) as srv:
            ttft[mode] = asyncio.run(flood_then_short(srv.url, flood, short, args.b_delay_s))
            shares[mode] = asyncio.run(backlogged_shares(srv.url, backlog))
    ratio = ttft["vtc"] / ttft["fcfs"]
    low, high = SHARE_TARGET
    return {
        "tenant_b_mean_ttft_s": ttft, "ttft_ratio": ratio, "ttft_target": f"<= {TTFT_TARGET_RATIO}",
        "ttft_met": ratio <= TTFT_TARGET_RATIO, "output_token_shares": shares,
        "shares_target": f"{low:.0%}-{high:.0%} each",
        "shares_met": all(low <= s <= high for s in shares["vtc"].values()),
    }  # fmt: skip


async def cached_share_and_time(url: str, bodies: list[dict[str, Any]]) -> tuple[float, float]:
    async with make_client(None, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, url)
        (await client.post(url + "/flush_cache")).raise_for_status()
        before = await cache_counters(client, url)
        start_s = time.perf_counter()
        await ttfts(client, url + COMPLETIONS_PATH, bodies)
        duration_s = time.perf_counter() - start_s
        after = await cache_counters(client, url)
    assert before is not None and after is not None
    return (after[0] - before[0]) / (after[1] - before[1]), duration_s


def lpm_workload(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [prompt(rng, LPM_PREFIX_LEN) for _ in range(LPM_PREFIXES)]
    bodies = [
        body(prefix + prompt(rng, LPM_SUFFIX_LEN), LPM_OUTPUT)
        for prefix in prefixes
        for _ in range(LPM_PER_PREFIX)
    ]
    rng.shuffle(bodies)
    figures = {}
    pool = [f"--num-pages={args.lpm_num_pages}"]
    for mode in ("fcfs", "lpm"):
        with server(args, [*pool, f"--schedule-policy={mode}"]) as srv:
            figures[mode] = asyncio.run(cached_share_and_time(srv.url, bodies))
    (fcfs_share, fcfs_s), (lpm_share, lpm_s) = figures["fcfs"], figures["lpm"]
    ratio = lpm_share / fcfs_share if fcfs_share else float("inf")
    return {
        "cached_token_share": {"fcfs": fcfs_share, "lpm": lpm_share}, "share_ratio": ratio,
        "share_target": f">= {LPM_HIT_TARGET_RATIO}", "share_met": ratio >= LPM_HIT_TARGET_RATIO,
        "wall_time_s": {"fcfs": fcfs_s, "lpm": lpm_s}, "time_met": lpm_s <= fcfs_s,
    }  # fmt: skip


WORKLOADS = {"priority": priority_workload, "fairness": fairness_workload, "lpm": lpm_workload}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--port", type=int, default=19190)
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--b-delay-s", type=float, default=1.0,
                   help="fairness: B sends this long after A's first requests run")  # fmt: skip
    p.add_argument("--lpm-num-pages", type=int, default=LPM_NUM_PAGES)
    args = p.parse_args(argv)
    results = {name: WORKLOADS[name](args) for name in args.workloads}
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
