"""Serving benchmark against any OpenAI-compatible server (minisgl, vLLM, SGLang, ...).

    python benchmark/online/bench_serving.py --base-url http://127.0.0.1:1919 \\
        --dataset random --num-prompts 64 --request-rate 1,2,4 --output-file results.jsonl
    python benchmark/online/bench_serving.py --dataset shared-prefix --max-concurrency 8
    python benchmark/online/bench_serving.py --dataset sharegpt --dataset-path sharegpt.json

Datasets:
  random         prompts of --random-input-len words (+-ratio), --random-output-len tokens (+-ratio)
  shared-prefix  --gsp-num-groups groups of --gsp-prompts-per-group prompts; each prompt is its
                 group's --gsp-system-prompt-len-word prefix plus a --gsp-question-len-word
                 question (SGLang's "generated-shared-prefix"), shuffled
  sharegpt       a ShareGPT-format JSON file: the first turn of each conversation is the prompt;
                 the output length is --sharegpt-output-len, or the reply's length estimated at
                 4 characters per token

Arrivals: a Poisson process at each --request-rate (req/s; `inf` sends all at once), optionally
capped at --max-concurrency requests in flight (`--request-rate inf --max-concurrency 8` is a
fixed concurrency of 8). One run, and one JSON line in --output-file, per rate.

Prompts are text made of common English words, most of them one token each in the usual BPE
vocabularies, so input token counts are close to the word counts; the exact counts come from the
server's usage. Requests go in the wire format of `vllm bench serve --backend openai-chat` (or
`openai` for /v1/completions); see bench_common.py. Synthetic datasets are drawn again with the
seed plus the run's index for every rate, so no run finds the previous run's prompts cached.
--num-warmup requests (other prompts) go first and are not counted.
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
    CHAT_PATH,
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

# Common English words; with their leading space most are single tokens in BPE vocabularies.
WORDS = (
    "the of and to in is was for on with as by at from that this it be are or an have not but "
    "they which one you had her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year"
).split()
CHARS_PER_TOKEN_ESTIMATE = 4.0  # for ShareGPT lengths without a tokenizer
MIN_SHAREGPT_TOKENS = 4  # vLLM drops shorter ShareGPT prompts and replies too
# Estimated lengths are rough: leave this fraction of the context for the estimate's error and the
# chat template's own tokens.
SHAREGPT_CONTEXT_HEADROOM = 0.8
WARMUP_PROMPT_WORDS = 16
WARMUP_OUTPUT_TOKENS = 8
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts come from a stream no run uses


@dataclass(frozen=True)
class DatasetRequest:
    prompt: str
    output_len: int


def random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def _around(rng: random.Random, center: int, ratio: float) -> int:
    """A length drawn uniformly from [center * (1 - ratio), center * (1 + ratio)], at least 1."""
    low = max(1, math.floor(center * (1 - ratio)))
    return rng.randint(low, max(low, math.ceil(center * (1 + ratio))))


def random_dataset(args: argparse.Namespace, seed: int) -> list[DatasetRequest]:
    rng = random.Random(seed)
    return [
        DatasetRequest(
            random_words(rng, _around(rng, args.random_input_len, args.random_range_ratio)),
            _around(rng, args.random_output_len, args.random_range_ratio),
        )
        for _ in range(args.num_prompts)
    ]


def shared_prefix_dataset(args: argparse.Namespace, seed: int) -> list[DatasetRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(args.gsp_num_groups):
        system = random_words(rng, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            question = random_words(rng, args.gsp_question_len)
            requests.append(DatasetRequest(f"{system}\n\n{question}", args.gsp_output_len))
    rng.shuffle(requests)
    return requests


def sharegpt_dataset(
    args: argparse.Namespace, seed: int, max_model_len: int | None
) -> list[DatasetRequest]:
    if args.dataset_path is None:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE.json")
    with open(args.dataset_path, encoding="utf-8") as f:
        conversations = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(conversations)
    budget = max_model_len * SHAREGPT_CONTEXT_HEADROOM if max_model_len else math.inf
    requests: list[DatasetRequest] = []
    for item in conversations:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len = len(prompt) / CHARS_PER_TOKEN_ESTIMATE
        output_len = args.sharegpt_output_len or round(len(reply) / CHARS_PER_TOKEN_ESTIMATE)
        if min(prompt_len, output_len) < MIN_SHAREGPT_TOKENS or prompt_len + output_len > budget:
            continue
        requests.append(DatasetRequest(prompt, int(output_len)))
        if len(requests) == args.num_prompts:
            break
    if len(requests) < args.num_prompts:
        print(f"only {len(requests)} usable conversations in {args.dataset_path}")
    return requests


def poisson_offsets(rng: random.Random, num_requests: int, rate: float) -> list[float]:
    """Send times (s from the start) of a Poisson process; all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, now_s = [], 0.0
    for _ in range(num_requests):
        offsets.append(now_s)
        now_s += rng.expovariate(rate)
    return offsets


def build_dataset(
    args: argparse.Namespace, seed: int, max_model_len: int | None
) -> list[DatasetRequest]:
    if args.dataset == "random":
        return random_dataset(args, seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(args, seed)
    return sharegpt_dataset(args, seed, max_model_len)


async def benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    base_url = args.base_url.rstrip("/")
    api = "chat" if args.backend == "openai-chat" else "completions"
    url = base_url + (CHAT_PATH if api == "chat" else COMPLETIONS_PATH)
    records: list[dict[str, Any]] = []
    async with make_client(args.api_key, args.request_timeout_s) as client:
        model, max_model_len = await served_model(client, base_url)
        model = args.model or model
        if args.num_warmup:
            rng = random.Random(args.seed + WARMUP_SEED_OFFSET)
            warmups = [
                build_payload(
                    RequestSpec(random_words(rng, WARMUP_PROMPT_WORDS), WARMUP_OUTPUT_TOKENS),
                    model,
                    api,
                    args.ignore_eos,
                    args.temperature,
                )
                for _ in range(args.num_warmup)
            ]
            await asyncio.gather(
                *(send_request(client, url, body, WARMUP_OUTPUT_TOKENS) for body in warmups)
            )
        for index, rate in enumerate(args.request_rate):
            dataset = build_dataset(args, args.seed + index, max_model_len)
            offsets = poisson_offsets(random.Random(args.seed + index), len(dataset), rate)
            specs = [
                RequestSpec(d.prompt, d.output_len, at_s)
                for d, at_s in zip(dataset, offsets, strict=True)
            ]
            bodies = [
                build_payload(s, model, api, args.ignore_eos, args.temperature) for s in specs
            ]
            summary = await measure(
                client,
                base_url,
                url,
                bodies,
                specs,
                args.max_concurrency,
                desc=f"rate {rate}",
                show_progress=not args.disable_tqdm,
            )
            record: dict[str, Any] = {
                "benchmark": "bench_serving",
                "label": args.label,
                "base_url": base_url,
                "model": model,
                "backend": args.backend,
                "dataset": args.dataset,
                "request_rate": rate,
                "max_concurrency": args.max_concurrency,
                "ignore_eos": args.ignore_eos,
                **summary,
                **run_info(sys.argv),
            }
            title = f"{args.label or model}: {args.dataset}, rate {rate}"
            if args.max_concurrency:
                title += f", concurrency {args.max_concurrency}"
            print_summary(title, record)
            if args.output_file:
                append_jsonl(args.output_file, record)
            records.append(record)
    return records


def _rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]  # float("inf") works
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive, e.g. 1,2,4 or inf")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--backend", choices=("openai-chat", "openai"), default="openai-chat")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "shared-prefix", "sharegpt"), default="random")
    p.add_argument("--dataset-path", type=Path, default=None, help="ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=_rates, default=[math.inf], help="req/s, comma list")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=256, help="words")
    p.add_argument("--random-output-len", type=int, default=64, help="tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=256, help="words")
    p.add_argument("--gsp-question-len", type=int, default=32, help="words")
    p.add_argument("--gsp-output-len", type=int, default=64, help="tokens")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="names this run in results and plots")
    p.add_argument("--output-file", default=None, help="append one JSON line per rate")
    p.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S)
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.dataset == "shared-prefix":
        args.num_prompts = args.gsp_num_groups * args.gsp_prompts_per_group
    return args


if __name__ == "__main__":
    asyncio.run(benchmark(parse_args()))
