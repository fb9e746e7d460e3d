"""Speculative decoding (n-gram drafts) on and off, on copy-heavy and non-repetitive chats.

Workloads (chat prompts built from this repository's own text, greedy):
  code-edit      rename a variable in a function: the reply repeats the code
  quote          quote a passage of the docs exactly
  multi-turn     repeat an earlier answer of the conversation, then add to it
  story          a short story (nothing to copy: drafts rarely match)
  copy-heavy     (a summary row) the first three together: their tokens over their time

Each workload runs at batch 1 (one request at a time) and at concurrency C (C requests at once),
with drafts and without, in this process: two engines, each run timed on one then the other
(`--rounds N`: N times, alternating, the figures summed over them).
Decode tok/s leaves the prefill out: each set of requests runs once with max_tokens 1 (the
prefill and first token) and once in full, from an empty prefix cache both times; decode tok/s =
(output tokens - first tokens) / (full time - prefill time). Greedy outputs must be identical
with and without drafts (checked; a mismatch exits 1).

`--server` runs the same through two `python -m minisgl.server` processes (ports --server-port
and the one after), each group of requests streamed at once over HTTP; outputs compared as text;
decode time there is each request's time from its first token to its end, averaged over a group.

    python benchmark/offline/bench_speculative.py
    python benchmark/offline/bench_speculative.py --workloads quote story --concurrency 16
    python benchmark/offline/bench_speculative.py --server
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "online"))
from bench_common import LocalServer  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.config import ServerArgs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = ("code-edit", "quote", "multi-turn", "story")
COPY_HEAVY = WORKLOADS[:3]  # what drafts are for; "story" is the non-repetitive one
DEFAULT_SERVER_PORT = 19190
WARM_UP_CHAT = [{"role": "user", "content": "Say hi."}]
SERVER_START_TIMEOUT_S = 300.0
STORY_SUBJECTS = ("a lighthouse keeper", "a fox", "a clockmaker", "a river", "a child", "a robot")


def _functions(limit: int) -> list[str]:
    """Functions of this repository's scheduler, as source text (a few lines each)."""
    found: list[str] = []
    for name in ("cache_manager.py", "decode.py", "speculative.py", "outputs.py"):
        text = (REPO / "minisgl" / "scheduler" / name).read_text()
        found += re.findall(r"\n(    def \w+\(.*?\n)(?=\n    (?:def |@)|\n\n\S|\Z)", text, re.S)
    short = [f for f in found if 6 <= f.count("\n") <= 18]
    return short[:limit]


def _passages(limit: int) -> list[str]:
    """Paragraphs of the docs of a few hundred characters."""
    paragraphs: list[str] = []
    for path in sorted((REPO / "docs").glob("*.md")):
        paragraphs += [p.strip() for p in path.read_text().split("\n\n")]
    plain = [p for p in paragraphs if 300 <= len(p) <= 700 and not p.startswith(("#", "```", "|"))]
    return plain[:limit]


def conversations(name: str, count: int) -> list[list[dict[str, str]]]:
    if name == "code-edit":
        return [
            [{"role": "user", "content": "Rename `req` to `request` in this code and reply with "
              f"the whole code only:\n\n```python\n{code}```"}]
            for code in _functions(count)
        ]  # fmt: skip
    if name == "quote":
        return [
            [{"role": "user", "content": f"Quote this passage exactly:\n\n{text}"}]
            for text in _passages(count)
        ]
    if name == "multi-turn":
        return [
            [
                {"role": "user", "content": "Explain this part of the server."},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Repeat your answer word for word."},
            ]
            for text in _passages(2 * count)[count:]
        ]
    subjects = (STORY_SUBJECTS * count)[:count]
    return [[{"role": "user", "content": f"Write a story about {s}."}] for s in subjects]


@dataclass
class Timing:
    output_tokens: int
    decode_tokens: int  # after each request's first
    total_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    def __add__(self, other: Timing) -> Timing:
        return Timing(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


Chat = list[dict[str, str]]
# Per request: what it wrote (token ids offline, text from the server), its token count, and
# (streamed from the server) the seconds from its first token to its end; None offline.
Reply = tuple[object, int, float | None]


class OfflineEngine:
    def __init__(self, model: str | None, options: dict[str, object]) -> None:
        self.llm = LLM(model, **options)
        self.chat([WARM_UP_CHAT], 4)  # the chat template's first rendering is slow

    def flush(self) -> None:
        self.llm.scheduler.flush_cache()

    def chat(self, chats: list[Chat], max_tokens: int) -> list[Reply]:
        outs = self.llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
        return [(o.token_ids, len(o.token_ids), None) for o in outs]

    def spec_counts(self) -> tuple[int, int]:
        stats = self.llm.scheduler.stats()
        return stats.spec_verify_steps_total, stats.spec_accepted_tokens_total

    def close(self) -> None:
        self.llm.shutdown()


class ServerEngine:
    """`python -m minisgl.server` with the same options, asked over HTTP (one connection per
    request of a group, all at once)."""

    def __init__(self, model: str | None, options: dict[str, object], port: int) -> None:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        self.server = LocalServer(model, port, flags, SERVER_START_TIMEOUT_S)
        self.url = self.server.url
        self.chat([WARM_UP_CHAT], 4)

    def flush(self) -> None:
        httpx.post(self.url + "/flush_cache", timeout=60).raise_for_status()

    def _one(self, chat: Chat, max_tokens: int) -> Reply:
        """Streamed: its text, its token count and the seconds from its first token to its end."""
        body = {
            **{"messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True},
            "stream_options": {"include_usage": True},
        }
        parts: list[str] = []
        first_s = num_tokens = None
        url = self.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=600) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                for choice in chunk["choices"]:
                    if choice["delta"].get("content") and first_s is None:
                        first_s = time.perf_counter()
                    parts.append(choice["delta"].get("content") or "")
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        assert num_tokens is not None, "no usage in the stream"
        decode_s = time.perf_counter() - first_s if first_s is not None else 0.0
        return "".join(parts), num_tokens, decode_s

    def chat(self, chats: list[Chat], max_tokens: int) -> list[Reply]:
        with ThreadPoolExecutor(len(chats)) as pool:
            return list(pool.map(lambda c: self._one(c, max_tokens), chats))

    def spec_counts(self) -> tuple[int, int]:
        text = httpx.get(self.url + "/metrics", timeout=10).text

        def value(name: str) -> int:
            found = re.search(rf"^minisgl:{name}_total (\S+)$", text, re.M)
            return int(float(found[1])) if found else 0

        return value("spec_decode_num_drafts"), value("spec_decode_num_accepted_tokens")

    def close(self) -> None:
        self.server.stop()


Engine = OfflineEngine | ServerEngine


def _timed(engine: Engine, chats: list[Chat], max_tokens: int) -> tuple[float, list[Reply]]:
    engine.flush()
    start = time.perf_counter()
    replies = engine.chat(chats, max_tokens)
    return time.perf_counter() - start, replies


def run_batches(
    engine: Engine, chats: list[Chat], max_tokens: int, batch: int
) -> tuple[Timing, list[object]]:
    timing = Timing(0, 0, 0.0, 0.0)
    written: list[object] = []
    for i in range(0, len(chats), batch):
        group = chats[i : i + batch]
        total_s, replies = _timed(engine, group, max_tokens)
        written += [what for what, _, _ in replies]
        num = sum(count for _, count, _ in replies)
        timing.output_tokens += num
        timing.decode_tokens += num - len(group)
        timing.total_s += total_s
        streamed = [s for _, _, s in replies if s is not None]
        if len(streamed) == len(replies):  # the mean request's decoding time
            timing.decode_s += sum(streamed) / len(streamed)
        else:  # offline: the time past the prefill and first tokens, run apart
            timing.decode_s += total_s - _timed(engine, group, 1)[0]
    return timing, written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="HF folder or hub id; default: bundled model")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=4, help="at batch 1; 0 skips it")
    p.add_argument("--concurrency", type=int, default=16, help="0 skips the concurrent runs")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--rounds", type=int, default=1, help="each run off then on, this many times")
    p.add_argument("--quantization", default=ServerArgs.quantization, help="none: fp32 weights")
    p.add_argument("--server", action="store_true", help="through two servers, over HTTP")
    p.add_argument("--server-port", type=int, default=DEFAULT_SERVER_PORT, help="and port + 1")
    p.add_argument("--num-draft-tokens", type=int, default=ServerArgs.speculative_num_draft_tokens)
    p.add_argument("--ngram-max-match", type=int, default=ServerArgs.speculative_ngram_max_match)
    p.add_argument("--ngram-min-match", type=int, default=ServerArgs.speculative_ngram_min_match)
    args = p.parse_args(argv)
    spec = {
        "speculative_algorithm": "ngram",
        "speculative_num_draft_tokens": args.num_draft_tokens,
        "speculative_ngram_min_match": args.ngram_min_match,
        "speculative_ngram_max_match": args.ngram_max_match,
    }
    model_options = {"quantization": args.quantization}
    sizes = [b for b, on in ((1, args.num_requests), (args.concurrency, args.concurrency)) if on]
    runs = [(name, batch) for name in args.workloads for batch in sizes]
    results: dict[tuple[str, int, bool], Timing] = {}
    outputs: dict[tuple[str, int, bool], list[object]] = {}
    counts: dict[tuple[str, int], list[int]] = {}  # verify steps, accepted drafts
    # Both engines loaded at once and each run timed off then on, back to back: this machine's
    # memory bandwidth drifts over minutes, which would otherwise favour one side.
    engines: dict[bool, Engine] = {}
    try:
        for drafts in (False, True):
            options = {**model_options, **(spec if drafts else {})}
            engines[drafts] = (
                ServerEngine(args.model, options, args.server_port + drafts)
                if args.server
                else OfflineEngine(args.model, options)
            )
        for name, batch in runs:
            chats = conversations(name, args.num_requests if batch == 1 else batch)
            counts[name, batch] = [0, 0]
            for _ in range(args.rounds):  # off, on, off, on ...: drift hits both alike
                for drafts, engine in engines.items():
                    before = engine.spec_counts()
                    r, outputs[name, batch, drafts] = run_batches(
                        engine, chats, args.max_tokens, batch
                    )
                    after = engine.spec_counts()
                    for i in range(2):
                        counts[name, batch][i] += after[i] - before[i]
                    key = (name, batch, drafts)
                    results[key] = results[key] + r if key in results else r
                    state = "on " if drafts else "off"
                    print(
                        f"{name:<10} batch {batch:<3} drafts {state} {r.output_tokens:>5} "
                        f"tokens  decode {r.decode_tok_s:7.1f} tok/s",
                        flush=True,
                    )
    finally:
        for engine in engines.values():
            engine.close()
    print(f"\n{'workload':<11}{'batch':>6}{'off tok/s':>11}{'on tok/s':>10}{'speedup':>9}"
          f"{'accept len':>12}{'same':>6}")  # fmt: skip
    same_everywhere = True
    for name, batch in runs:
        off, on = results[name, batch, False], results[name, batch, True]
        same = outputs[name, batch, False] == outputs[name, batch, True]
        same_everywhere &= same
        verifies, accepted = counts[name, batch]
        accept = (accepted + verifies) / verifies if verifies else 0.0
        print(f"{name:<11}{batch:>6}{off.decode_tok_s:>11.1f}{on.decode_tok_s:>10.1f}"
              f"{on.decode_tok_s / off.decode_tok_s:>8.2f}x{accept:>12.2f}"
              f"{'yes' if same else 'NO':>6}")  # fmt: skip
    # The copy-heavy workload is the three copying kinds together: their decode tokens
    # over their decode time, with drafts and without.
    for batch in sorted({b for _, b in runs}):
        kinds = [name for name, b in runs if b == batch and name in COPY_HEAVY]
        if len(kinds) > 1:
            tok_s = [
                sum(results[n, batch, d].decode_tokens for n in kinds)
                / sum(results[n, batch, d].decode_s for n in kinds)
                for d in (False, True)
            ]
            print(f"{'copy-heavy':<11}{batch:>6}{tok_s[0]:>11.1f}{tok_s[1]:>10.1f}"
                  f"{tok_s[1] / tok_s[0]:>8.2f}x  ({' + '.join(kinds)})")  # fmt: skip
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
