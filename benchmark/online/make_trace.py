"""Generate a small multi-turn request trace in the Qwen "traceA" JSONL format.

The real trace (Alibaba's qwen-bailian-usagetraces-anon) cannot be downloaded here, so
`traces/synthetic_traceA.jsonl` is made by this script with its defaults (seed 0):

    python benchmark/online/make_trace.py          # rewrites traces/synthetic_traceA.jsonl
    python benchmark/online/make_trace.py --seed 1 --num-conversations 200 --out my_trace.jsonl

One JSON object per line, in timestamp order, with the real trace's fields: chat_id,
parent_chat_id (-1 for a first turn), timestamp (seconds from the start), input_length,
output_length, type ("text"), turn (1 for a first turn) and hash_ids (ids of the prompt's
16-token blocks; equal ids mean equal content). How the content is shaped:

- Conversations start as a Poisson process. Each one belongs to an "app" whose system prompt
  (a few blocks, chosen with skewed popularity) begins every one of its conversations' prompts,
  as shared system prompts do in production traffic.
- A later turn's prompt is the previous turn's prompt (all its block ids), then new blocks for the
  previous answer and the new user message: later turns extend earlier ones, as in a chat.
- The next turn arrives a think time (exponential) after the previous one.
- The last block of a prompt may be partial (input_length is not a multiple of 16); the next turn
  reuses its id as a full block, so a turn's prompt is always a prefix of the next turn's.
- A conversation ends after its turns, or before a prompt would pass --max-input-len.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

BLOCK_SIZE_TOKENS = 16  # the trace format's block size
DEFAULT_OUT = Path(__file__).parent / "traces" / "synthetic_traceA.jsonl"


@dataclass(frozen=True)
class TraceConfig:
    num_conversations: int = 24
    conversation_rate_per_s: float = 0.25  # Poisson arrivals of first turns
    num_apps: int = 3
    app_popularity_skew: float = 1.5  # Zipf-like exponent: app k is picked with weight 1/k^skew
    system_prompt_blocks: tuple[int, int] = (8, 20)  # min, max
    user_message_blocks: tuple[int, int] = (2, 8)
    max_turns: int = 4
    continue_probability: float = 0.6  # after each turn, another one follows with this chance
    think_time_mean_s: float = 8.0
    output_len: tuple[int, int] = (16, 64)
    max_input_len: int = 896  # fits a 1024-token context with the longest output


@dataclass(frozen=True)
class TraceLine:
    chat_id: int
    parent_chat_id: int
    timestamp: float
    input_length: int
    output_length: int
    type: str
    turn: int
    hash_ids: list[int]


def generate(config: TraceConfig, seed: int) -> list[TraceLine]:
    rng = random.Random(seed)
    next_block = itertools.count(1)
    apps = [
        [next(next_block) for _ in range(rng.randint(*config.system_prompt_blocks))]
        for _ in range(config.num_apps)
    ]
    weights = [1.0 / (k + 1) ** config.app_popularity_skew for k in range(config.num_apps)]
    # (timestamp, conversation, turn, hash_ids, input_length, output_length)
    turns: list[tuple[float, int, int, list[int], int, int]] = []
    start_s = 0.0
    for conversation in range(config.num_conversations):
        start_s += rng.expovariate(config.conversation_rate_per_s)
        blocks = list(rng.choices(apps, weights)[0])
        previous_output = 0
        time_s = start_s
        for turn in range(1, config.max_turns + 1):
            new_tokens = previous_output + BLOCK_SIZE_TOKENS * rng.randint(
                *config.user_message_blocks
            )
            candidate = blocks + [
                next(next_block) for _ in range(-(-new_tokens // BLOCK_SIZE_TOKENS))
            ]
            # A partial last block: up to 15 tokens short of the full blocks.
            input_len = BLOCK_SIZE_TOKENS * len(candidate) - rng.randrange(BLOCK_SIZE_TOKENS)
            if input_len > config.max_input_len:
                break
            blocks = candidate
            output_len = rng.randint(*config.output_len)
            turns.append((time_s, conversation, turn, list(blocks), input_len, output_len))
            if rng.random() >= config.continue_probability:
                break
            previous_output = output_len
            time_s += rng.expovariate(1.0 / config.think_time_mean_s)
    turns.sort(key=lambda t: t[0])
    lines: list[TraceLine] = []
    last_chat_of: dict[int, int] = {}  # conversation -> chat_id of its latest turn so far
    for chat_id, (time_s, conversation, turn, hash_ids, input_len, output_len) in enumerate(turns):
        parent = last_chat_of.get(conversation, -1)
        last_chat_of[conversation] = chat_id
        timestamp_s = round(time_s, 3)
        lines.append(
            TraceLine(chat_id, parent, timestamp_s, input_len, output_len, "text", turn, hash_ids)
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-conversations", type=int, default=TraceConfig.num_conversations)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    lines = generate(TraceConfig(num_conversations=args.num_conversations), args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(asdict(line)) + "\n")
    print(f"wrote {len(lines)} requests to {args.out}")


if __name__ == "__main__":
    main()
