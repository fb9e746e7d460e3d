"""Replay a Qwen "traceA" request trace against a running OpenAI-compatible server.

    python -m minisgl.server --port 1919 &
    python benchmark/online/bench_qwen.py --base-url http://127.0.0.1:1919 \\
        --num-requests 32 --scales 0.4,0.8,1.6 --output-file results.jsonl

The trace is JSON lines in the format of Alibaba's qwen-bailian-usagetraces-anon ("traceA"):
chat_id, parent_chat_id, timestamp (s), input_length, output_length, type, turn and hash_ids,
the ids of the prompt's 16-token blocks (equal ids: equal content). `--trace PATH` takes the real
file; the default is a small generated multi-turn trace (traces/synthetic_traceA.jsonl, made by
make_trace.py, which says how).

Each request is sent at its timestamp times the scale (smaller scale: faster arrivals), streamed,
with `ignore_eos` and max_tokens = output_length, so it produces exactly output_length tokens.
Its prompt is built from its hash_ids: every id maps to one fixed random block of 16 token ids,
and the prompt is the blocks in order cut to input_length tokens. Requests that share leading
block ids therefore share exactly that prompt prefix, as in the trace. Prompts go as token ids to
/v1/completions, so lengths and shared prefixes are exact whatever the server's tokenizer.
Each scale uses fresh block content (the seed plus the scale's index), so no run finds the
previous run's prompts in the server's prefix cache.

Reports request and token counts, TTFT, TPOT, inter-chunk latency and end-to-end latency (mean,
p50, p90, p99, max), throughput and the server's prefix-cache hit rate over the run (from its
/metrics), and appends one JSON line per scale to --output-file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import (
    COMPLETIONS_PATH,
    DEFAULT_REQUEST_TIMEOUT_S,
    RequestSpec,
    append_jsonl,
    build_payload,
    make_client,
    measure,
    print_summary,
    run_info,
    send_request,
    served_model,
)

BLOCK_SIZE_TOKENS = 16  # the trace format's block size
DEFAULT_TRACE = Path(__file__).parent / "traces" / "synthetic_traceA.jsonl"
# Block tokens are drawn from this id range: ordinary (not special) tokens in every vocabulary we
# target (Llama-2/Mistral 32000, SmolLM2 49152, Llama-3 128256, Qwen 151k), whose special and
# byte tokens sit at the very start or the very end.
DEFAULT_TOKEN_ID_RANGE = (1000, 30000)
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4
TRACE_FIELDS = (
    "chat_id",
    "parent_chat_id",
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
)


@dataclass(frozen=True)
class TraceRecord:
    chat_id: int
    parent_chat_id: int
    timestamp_s: float
    input_length: int
    output_length: int
    turn: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, num_requests: int | None) -> list[TraceRecord]:
    """The first `num_requests` lines of a traceA JSONL file (all of them if None)."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if num_requests is not None and len(records) >= num_requests:
                break
            if not line.strip():
                continue
            raw = json.loads(line)
            missing = [name for name in TRACE_FIELDS if name not in raw]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing trace fields {missing}")
            records.append(
                TraceRecord(
                    chat_id=int(raw["chat_id"]),
                    parent_chat_id=int(raw["parent_chat_id"]),
                    timestamp_s=float(raw["timestamp"]),
                    input_length=int(raw["input_length"]),
                    output_length=int(raw["output_length"]),
                    turn=int(raw.get("turn", 1)),
                    hash_ids=tuple(int(h) for h in raw["hash_ids"]),
                )
            )
    return records


class BlockPrompts:
    """Token-id prompts from hash_ids: one fixed random 16-token block per id."""

    def __init__(self, seed: int, token_id_range: tuple[int, int]) -> None:
        self.seed = seed
        self.low, self.high = token_id_range
        self._blocks: dict[int, list[int]] = {}

    def random_tokens(self, key: str, num_tokens: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")  # str seeds hash with sha512: stable across runs
        return [rng.randrange(self.low, self.high) for _ in range(num_tokens)]

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self.random_tokens(f"block:{hash_id}", BLOCK_SIZE_TOKENS)
        return self._blocks[hash_id]

    def prompt(self, record: TraceRecord) -> list[int]:
        ids = [token for hash_id in record.hash_ids for token in self.block(hash_id)]
        if len(ids) < record.input_length:
            # The blocks do not cover the prompt: fill with tokens of this request alone.
            short = record.input_length - len(ids)
            ids += self.random_tokens(f"fill:{record.chat_id}", short)
        return ids[: record.input_length]


def trace_specs(
    records: list[TraceRecord], prompts: BlockPrompts, scale: float
) -> list[RequestSpec]:
    start_s = records[0].timestamp_s if records else 0.0
    return [
        RequestSpec(
            prompt=prompts.prompt(r),
            output_len=max(1, r.output_length),
            send_at_s=(r.timestamp_s - start_s) * scale,
            prompt_len=r.input_length,
        )
        for r in records
    ]


def offered_request_rate(specs: list[RequestSpec]) -> float:
    """Requests per second the schedule offers (inf when they all arrive at once)."""
    span_s = max((s.send_at_s for s in specs), default=0.0)
    return len(specs) / span_s if span_s > 0 else math.inf


async def replay(args: argparse.Namespace) -> list[dict[str, Any]]:
    base_url = args.base_url.rstrip("/")
    url = base_url + COMPLETIONS_PATH
    records = load_trace(args.trace, args.num_requests)
    records_out: list[dict[str, Any]] = []
    async with make_client(args.api_key, args.request_timeout_s) as client:
        model, max_model_len = await served_model(client, base_url)
        model = args.model or model
        fits = [
            r
            for r in records
            if max_model_len is None or r.input_length + max(1, r.output_length) <= max_model_len
        ]
        skipped = len(records) - len(fits)
        if skipped:
            print(f"skipping {skipped} requests longer than the context ({max_model_len} tokens)")
        if not fits:
            raise SystemExit("no request of the trace fits the server's context length")
        for index, scale in enumerate(args.scales):
            prompts = BlockPrompts(args.seed + index, tuple(args.token_id_range))
            specs = trace_specs(fits, prompts, scale)
            bodies = [
                build_payload(s, model, "completions", ignore_eos=True, temperature=0.0)
                for s in specs
            ]
            for i in range(args.num_warmup):  # excluded from every figure
                warmup = RequestSpec(
                    prompts.random_tokens(f"warmup:{i}", WARMUP_PROMPT_TOKENS),
                    WARMUP_OUTPUT_TOKENS,
                )
                body = build_payload(warmup, model, "completions", True, 0.0)
                await send_request(client, url, body, WARMUP_OUTPUT_TOKENS)
            summary = await measure(
                client,
                base_url,
                url,
                bodies,
                specs,
                args.max_concurrency,
                desc=f"scale {scale}",
                show_progress=not args.disable_tqdm,
            )
            record: dict[str, Any] = {
                "benchmark": "bench_qwen",
                "label": args.label,
                "base_url": base_url,
                "model": model,
                "trace": str(args.trace),
                "scale": scale,
                "request_rate": offered_request_rate(specs),
                "max_concurrency": args.max_concurrency,
                "skipped_too_long": skipped,
                "expected_input_tokens": sum(s.prompt_len or 0 for s in specs),
                **summary,
                **run_info(sys.argv),
            }
            print_summary(f"{args.label or model}: trace scale {scale}", record)
            if args.output_file:
                append_jsonl(args.output_file, record)
            records_out.append(record)
    return records_out


def _scales(text: str) -> list[float]:
    scales = [float(part) for part in text.split(",") if part.strip()]
    if not scales or any(s <= 0 for s in scales):
        raise argparse.ArgumentTypeError("scales must be positive numbers, e.g. 0.4,0.8,1.6")
    return scales


def _id_range(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(","))
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError("expected LOW,HIGH with 0 <= LOW < HIGH")
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="traceA JSONL file")
    p.add_argument("--num-requests", type=int, default=None, help="the first N trace lines")
    p.add_argument(
        "--scales",
        type=_scales,
        default=[1.0],
        help="comma-separated time scales; one run each (smaller: faster arrivals)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0, help="block content seed")
    p.add_argument("--token-id-range", type=_id_range, default=DEFAULT_TOKEN_ID_RANGE)
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument("--label", default="", help="names this run in results and plots")
    p.add_argument("--output-file", default=None, help="append one JSON line per scale")
    p.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S)
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(replay(parse_args()))
