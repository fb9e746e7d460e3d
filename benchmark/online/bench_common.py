"""What the online benchmarks share: the wire format, timing, percentiles, results as JSON lines.

Requests use the same wire format as `vllm bench serve` and `sglang.bench_serving`, so one
command measures minisgl and another OpenAI-compatible server side by side:

  chat         POST /v1/chat/completions  messages=[{"role": "user", "content": [{"type": "text",
               "text": prompt}]}], max_completion_tokens, stream, stream_options.include_usage
  completions  POST /v1/completions       prompt (text or token ids), max_tokens, stream, ...

both with `ignore_eos` (exact output lengths) and temperature 0. Token counts come from the final
usage chunk, never from counting chunks: one chunk can carry several tokens. TTFT is timed at the
first chunk that carries text; TPOT is (latency - TTFT) / (output tokens - 1), as vLLM defines it.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

MS_PER_S = 1000.0
DEFAULT_REQUEST_TIMEOUT_S = 3600.0
METRICS_TIMEOUT_S = 10.0
PERCENTILES = (50, 90, 99)
SSE_DATA = "data: "
SSE_DONE = "[DONE]"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Prefix-cache counters (hits, queries), both in prompt tokens, of the servers we know.
CACHE_COUNTERS = (
    ("minisgl:prefix_cache_hits_total", "minisgl:prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
)
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: `send_at_s` is its offset from the start of the run."""

    prompt: str | list[int]  # text, or token ids (completions only)
    output_len: int
    send_at_s: float = 0.0
    prompt_len: int | None = None  # known in advance (token-id prompts), else from usage


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    expected_output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks that carry text

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(
    spec: RequestSpec, model: str, api: str, ignore_eos: bool, temperature: float
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if api == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("chat requests take text prompts")
        content = [{"type": "text", "text": spec.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.output_len
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], expected_output_tokens: int
) -> RequestResult:
    result = RequestResult(expected_output_tokens=expected_output_tokens)
    start_s = time.perf_counter()
    last_s = 0.0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != httpx.codes.OK:
                detail = (await response.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith(SSE_DATA):
                    continue
                payload = line[len(SSE_DATA) :]
                if payload == SSE_DONE:
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    result.error = str(message)[:200]
                    return result
                now_s = time.perf_counter()
                if _chunk_text(chunk):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now_s - start_s
                    else:
                        result.itl_s.append(now_s - last_s)
                    last_s = now_s
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e_s = time.perf_counter() - start_s
    if result.ttft_s == 0.0:  # nothing but empty text: the end is the first token
        result.ttft_s = result.e2e_s
    result.ok = True
    return result


class LocalServer:
    """`python -m minisgl.server` on 127.0.0.1:`port` with `flags` (`model`: None for the bundled
    one), up once /health answers; RuntimeError if it exits or is not up in `timeout_s`."""

    def __init__(
        self, model: str | None, port: int, flags: list[str], timeout_s: float = 600.0
    ) -> None:
        model_flag = [f"--model={model}"] if model else []
        command = [sys.executable, "-m", "minisgl.server", f"--port={port}", *model_flag, *flags]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline_s = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline_s:
                self.stop()
                raise RuntimeError(f"the server on port {port} ({' '.join(flags)}) did not start")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def make_client(api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No connection cap: a trace replay may hold hundreds of streams open at once.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits)


async def served_model(client: httpx.AsyncClient, base_url: str) -> tuple[str, int | None]:
    """(model id, max_model_len if the server says) from /v1/models."""
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    card = response.json()["data"][0]
    return card["id"], card.get("max_model_len")


async def run_requests(
    client: httpx.AsyncClient,
    url: str,
    bodies: Sequence[dict[str, Any]],
    specs: Sequence[RequestSpec],
    max_concurrency: int | None,
    desc: str,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send each request at its `send_at_s` (at most `max_concurrency` in flight); wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=desc, unit="req", disable=not show_progress)
    start_s = time.perf_counter()

    async def one(spec: RequestSpec, body: dict[str, Any]) -> RequestResult:
        delay_s = spec.send_at_s - (time.perf_counter() - start_s)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if limit is None:
            result = await send_request(client, url, body, spec.output_len)
        else:
            async with limit:
                result = await send_request(client, url, body, spec.output_len)
        bar.update(1)
        return result

    results = await asyncio.gather(*(one(s, b) for s, b in zip(specs, bodies, strict=True)))
    duration_s = time.perf_counter() - start_s
    bar.close()
    return list(results), duration_s


async def measure(
    client: httpx.AsyncClient,
    base_url: str,
    url: str,
    bodies: Sequence[dict[str, Any]],
    specs: Sequence[RequestSpec],
    max_concurrency: int | None,
    desc: str,
    show_progress: bool,
) -> dict[str, Any]:
    """One timed run: the requests, plus the server's prefix-cache counters around them."""
    cache_before = await cache_counters(client, base_url)
    results, duration_s = await run_requests(
        client, url, bodies, specs, max_concurrency, desc, show_progress
    )
    cache_after = await cache_counters(client, base_url)
    return summarize(results, duration_s, cache_before, cache_after)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labelled series of one name summed."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


async def cache_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """The server's prefix-cache (hits, queries) in tokens, or None if it exports neither."""
    try:
        response = await client.get(base_url + "/metrics", timeout=METRICS_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != httpx.codes.OK:
        return None
    values = parse_metrics(response.text)
    for hits, queries in CACHE_COUNTERS:
        if hits in values and queries in values:
            return values[hits], values[queries]
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max of `values_s`, in milliseconds, keyed like vLLM's results."""
    if not values_s:
        return {f"{stat}_{name}_ms": math.nan for stat in ("mean", "p50", "p90", "p99", "max")}
    stats = {f"mean_{name}_ms": statistics.fmean(values_s) * MS_PER_S}
    for q in PERCENTILES:
        stats[f"p{q}_{name}_ms"] = percentile(values_s, q) * MS_PER_S
    stats[f"max_{name}_ms"] = max(values_s) * MS_PER_S
    return stats


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    cache_before: tuple[float, float] | None,
    cache_after: tuple[float, float] | None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        # Client side: what the server reported in usage.prompt_tokens_details.cached_tokens.
        "usage_cached_tokens": cached_tokens,
        "usage_cache_hit_rate": cached_tokens / input_tokens if input_tokens else math.nan,
    }
    summary.update(latency_stats("ttft", [r.ttft_s for r in ok]))
    summary.update(latency_stats("tpot", [t for r in ok if (t := r.tpot_s) is not None]))
    summary.update(latency_stats("itl", [gap for r in ok for gap in r.itl_s]))
    summary.update(latency_stats("e2el", [r.e2e_s for r in ok]))
    # Server side: the prefix-cache counters' growth over the run (every request, warm-up
    # excluded, as the server counted them).
    hit_rate = math.nan
    if cache_before is not None and cache_after is not None:
        hits = cache_after[0] - cache_before[0]
        queries = cache_after[1] - cache_before[1]
        summary["server_cache_hit_tokens"] = hits
        summary["server_cache_query_tokens"] = queries
        hit_rate = hits / queries if queries else math.nan
    summary["prefix_cache_hit_rate"] = hit_rate
    return summary


def run_info(argv: Sequence[str]) -> dict[str, Any]:
    """When, where and how a result was made."""
    load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
        "load_avg_1m": load_1m,
        "python": platform.python_version(),
        "command": " ".join(["python", *argv]),
    }


def _json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_json_safe(record)) + "\n")


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_summary(title: str, record: dict[str, Any], file: Any = sys.stdout) -> None:
    print(f"\n==== {title} ====", file=file)
    rows = [
        ("requests ok / sent", f"{record['completed']} / {record['num_requests']}"),
        (
            "input / output tokens",
            f"{record['total_input_tokens']} / {record['total_output_tokens']}",
        ),
        ("duration s", _fmt(record["duration_s"])),
        ("request throughput req/s", _fmt(record["request_throughput"])),
        ("output throughput tok/s", _fmt(record["output_throughput"])),
        ("total throughput tok/s", _fmt(record["total_token_throughput"])),
        ("prefix-cache hit rate (server)", _fmt(record["prefix_cache_hit_rate"])),
        ("cached tokens (usage)", _fmt(record["usage_cached_tokens"])),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = " / ".join(
            _fmt(record[f"{stat}_{name}_ms"]) for stat in ("mean", "p50", "p90", "p99", "max")
        )
        rows.append((f"{name.upper()} ms mean/p50/p90/p99/max", stats))
    for name, value in rows:
        print(f"{name:<36} {value}", file=file)
    if record["errors"]:
        print(f"{'errors':<36} {record['errors']}", file=file)
