"""Offline throughput benchmark: minisgl's continuous batching vs HF transformers `generate`.

Workloads (token-id prompts drawn from the vocabulary with a fixed seed, ignore_eos, greedy):
  random         N requests with uniform random input and output lengths
  shared-prefix  groups of requests sharing a long system prompt, each with a short suffix

By default the benchmark steps `llm.scheduler` itself (the loop `LLM.generate` runs) so it can time
each request's first token; `--via-generate` goes through `LLM.generate(use_tqdm=True)` instead.
`--hf` runs the same workload through HF `generate` (fp32, left-padded batches) in the same process;
`--compare` runs the workload under radix vs naive cache and overlap on vs off; `--gpu-matrix`
runs it for each attention backend with overlap on/off and CUDA graphs on/off (one table);
`--decode-floor` puts batch-1 decode and the workload next to the hardware's floors, measured in
the same run (decode_floor.py).

    python benchmark/offline/bench.py                      # random workload, minisgl only
    python benchmark/offline/bench.py --hf                 # plus HF generate and the speedup
    python benchmark/offline/bench.py --workload shared-prefix --compare
    python benchmark/offline/bench.py --decode-floor --num-requests 16 --min-input-len 16 \
        --max-input-len 128 --min-output-len 16 --max-output-len 96   # CPU speed vs its floors
    python benchmark/offline/bench.py --model /tmp/qwen3-0.6b --num-requests 256 \
        --min-input-len 100 --max-input-len 1024 --min-output-len 100 --max-output-len 1024 \
        --gpu-matrix --backends flashinfer,triton      # Mini-SGLang's workload, on CUDA
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before torch loads libgomp: passive OpenMP waits, as `import minisgl` sets (see its __init__).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from minisgl import LLM, SamplingParams
from minisgl.config import ServerArgs
from minisgl.core import Req, next_request_id
from minisgl.engine.engine import resolve_device, resolve_dtype
from minisgl.models.model_config import load_model_config
from minisgl.models.resolve import resolve_model_path

WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4
WARMUP_NUM_REQUESTS = 2
MS_PER_S = 1000.0


@dataclass(frozen=True)
class EngineConfig:
    """The knobs one benchmark run varies; the rest come from the command line."""

    cache_type: str
    overlap: str  # auto | on | off
    attention_backend: str = "auto"
    graphs: bool | None = None  # None: the engine's default (on for CUDA)

    @property
    def label(self) -> str:
        label = f"minisgl {self.cache_type} overlap={self.overlap}"
        if self.attention_backend != "auto":
            label += f" {self.attention_backend}"
        if self.graphs is not None:
            label += f" graphs={'on' if self.graphs else 'off'}"
        return label


COMPARE_CONFIGS = tuple(
    EngineConfig(cache, overlap) for cache in ("radix", "naive") for overlap in ("on", "off")
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    label: str
    num_requests: int
    num_input_tokens: int
    num_output_tokens: int  # useful output only: each request's own requested tokens
    total_s: float
    cpu_s: float  # process CPU time (all threads): less sensitive to other load than wall time
    ttft_s: list[float] = field(default_factory=list)  # per request, from the start of the run
    prompt_tokens: int = 0  # from scheduler stats (minisgl only)
    cached_prompt_tokens: int = 0

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.total_s

    @property
    def total_tok_s(self) -> float:
        return (self.num_input_tokens + self.num_output_tokens) / self.total_s

    @property
    def ttft_mean_ms(self) -> float | None:
        return statistics.fmean(self.ttft_s) * MS_PER_S if self.ttft_s else None

    @property
    def ttft_p50_ms(self) -> float | None:
        return statistics.median(self.ttft_s) * MS_PER_S if self.ttft_s else None

    @property
    def cache_hit(self) -> float | None:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None


# ---- workloads -----------------------------------------------------------------------------------


def _random_ids(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def random_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        input_len = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append(_random_ids(rng, vocab_size, input_len))
        output_lens.append(rng.randint(args.min_output_len, args.max_output_len))
    return Workload("random", prompts, output_lens)


def shared_prefix_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """`num_groups` system prompts of `prefix_len` tokens, `group_size` suffixes each; the
    requests are shuffled so groups interleave, as they would arriving at a server."""
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_groups):
        prefix = _random_ids(rng, vocab_size, args.prefix_len)
        for _ in range(args.group_size):
            suffix_len = rng.randint(args.min_suffix_len, args.max_suffix_len)
            output_len = rng.randint(args.min_output_len, args.max_output_len)
            requests.append((prefix + _random_ids(rng, vocab_size, suffix_len), output_len))
    rng.shuffle(requests)
    return Workload("shared-prefix", [p for p, _ in requests], [n for _, n in requests])


def build_workload(args: argparse.Namespace) -> Workload:
    vocab_size = load_model_config(resolve_model_path(args.model)).vocab_size
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args, vocab_size)
    return random_workload(args, vocab_size)


def sampling_params(output_lens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]


# ---- minisgl -------------------------------------------------------------------------------------


def engine_options(args: argparse.Namespace, config: EngineConfig) -> dict:
    options: dict[str, Any] = {
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "cache_type": config.cache_type,
        "overlap": config.overlap,
        "attention_backend": config.attention_backend,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if config.graphs is not None:
        options["cuda_graph_max_bs"] = None if config.graphs else 0
    if args.num_pages is not None:
        options["num_pages"] = args.num_pages
    if args.speculative_algorithm is not None:
        options["speculative_algorithm"] = args.speculative_algorithm
        options["speculative_num_draft_tokens"] = args.speculative_num_draft_tokens
        options["speculative_ngram_min_match"] = args.speculative_ngram_min_match
        options["speculative_ngram_max_match"] = args.speculative_ngram_max_match
    return options


def warm_up(llm: LLM) -> None:
    """One tiny batch so lazy initialisation is not timed; then empty the prefix cache."""
    prompts = [list(range(1, WARMUP_PROMPT_LEN + 1))] * WARMUP_NUM_REQUESTS
    llm.generate(prompts, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True))
    llm.scheduler.flush_cache()


def workload_requests(workload: Workload) -> list[Req]:
    """The workload as scheduler requests (fresh ids: a workload can run several times)."""
    return [
        Req(next_request_id(), list(prompt), sp)
        for prompt, sp in zip(workload.prompts, sampling_params(workload.output_lens), strict=True)
    ]


def step_scheduler(llm: LLM, workload: Workload, use_tqdm: bool) -> tuple[float, list[float], int]:
    """Drive the scheduler as `LLM.generate` does, timing each request's first output token.
    Returns (total seconds, TTFT seconds per request, output tokens received)."""
    scheduler = llm.scheduler
    reqs = workload_requests(workload)
    first_token_s: dict[str, float] = {}
    pending = {req.rid for req in reqs}
    num_output_tokens = 0
    bar = tqdm(total=len(reqs), disable=not use_tqdm, desc="minisgl", unit="req")
    start = time.perf_counter()
    for req in reqs:
        scheduler.add_request(req)
    while pending:
        outputs = scheduler.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"{out.rid}: {out.error}")
            if out.num_new_tokens and out.rid not in first_token_s:
                first_token_s[out.rid] = now - start
            num_output_tokens += out.num_new_tokens
            if out.finish_reason is not None and out.rid in pending:
                pending.discard(out.rid)
                bar.update(1)
    total_s = time.perf_counter() - start
    bar.close()
    return total_s, [first_token_s[req.rid] for req in reqs], num_output_tokens


def time_minisgl_once(llm: LLM, workload: Workload, label: str, via_generate: bool) -> RunResult:
    llm.scheduler.flush_cache()  # every repeat starts from an empty prefix cache
    before = llm.scheduler.stats()
    ttft: list[float] = []
    cpu_start = time.process_time()
    if via_generate:
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, sampling_params(workload.output_lens), True)
        total_s = time.perf_counter() - start
        num_output_tokens = sum(len(o.token_ids) for o in outs)
    else:
        total_s, ttft, num_output_tokens = step_scheduler(llm, workload, use_tqdm=True)
    cpu_s = time.process_time() - cpu_start
    after = llm.scheduler.stats()
    if num_output_tokens != workload.num_output_tokens:
        wanted = workload.num_output_tokens
        raise RuntimeError(f"got {num_output_tokens} output tokens, wanted {wanted}")
    print(
        f"prefill computed {after.prefill_tokens_total - before.prefill_tokens_total} tokens, "
        f"retractions {after.num_retractions_total - before.num_retractions_total}"
    )
    if llm.scheduler.speculator is not None:
        verifies = after.spec_verify_steps_total - before.spec_verify_steps_total
        drafted = after.spec_draft_tokens_total - before.spec_draft_tokens_total
        accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
        length = (accepted + verifies) / verifies if verifies else 0.0
        print(
            f"speculative: {verifies} verify steps, {drafted} draft tokens, {accepted} accepted, "
            f"accept length {length:.2f} tokens per verify step"
        )
    return RunResult(
        label,
        len(workload.prompts),
        workload.num_input_tokens,
        workload.num_output_tokens,
        total_s,
        cpu_s,
        ttft,
        prompt_tokens=after.prompt_tokens_total - before.prompt_tokens_total,
        cached_prompt_tokens=after.cached_prompt_tokens_total - before.cached_prompt_tokens_total,
    )


def run_minisgl(args: argparse.Namespace, workload: Workload, config: EngineConfig) -> RunResult:
    label = config.label
    print(f"\n== {label}: loading", flush=True)
    llm = LLM(model=args.model, **engine_options(args, config))
    try:
        warm_up(llm)
        runs = []
        for _ in range(args.repeat):
            runs.append(time_minisgl_once(llm, workload, label, args.via_generate))
            print_result(runs[-1])
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return fastest(runs)


def run_isolated(argv: list[str], config: EngineConfig) -> RunResult:
    """Run one config in a child process: a GPU engine sizes its KV pool from free memory, so
    each config must start from an empty device, not from what the previous one left cached."""
    graphs = {None: "default", True: "on", False: "off"}[config.graphs]
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        child = [
            *argv,
            "--cache-type", config.cache_type,
            "--overlap", config.overlap,
            "--attention-backend", config.attention_backend,
            "--cuda-graphs", graphs,
            "--result-json", str(result_path),
        ]  # fmt: skip
        proc = subprocess.run([sys.executable, __file__, *child], check=False)
        if proc.returncode != 0:
            print(f"== {config.label}: FAILED (exit {proc.returncode})", flush=True)
            return RunResult(config.label + " FAILED", 0, 0, 0, float("nan"), 0.0)
        return RunResult(**json.loads(result_path.read_text()))


def fastest(runs: list[RunResult]) -> RunResult:
    """Other load on the machine only ever slows a run down: the fastest repeat is the estimate."""
    best = min(runs, key=lambda r: r.total_s)
    if len(runs) > 1:
        times = ", ".join(f"{r.total_s:.1f}" for r in runs)
        print(f"{best.label}: {len(runs)} repeats ({times} s), keeping the fastest")
    return best


# ---- HF transformers -----------------------------------------------------------------------------


class _FirstCallClock:
    """A logits processor that only notes when it is first called: right after the prefill, i.e.
    when the batch's first tokens exist."""

    def __init__(self) -> None:
        self.first_call_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter()
        return scores


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def _hf_generate(
    model: Any, prompts: list[list[int]], num_new: int, pad_id: int, clock: _FirstCallClock | None
) -> None:
    from transformers import LogitsProcessorList

    ids, mask = _left_padded(prompts, pad_id)
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,  # EOS is suppressed until then: ignore_eos
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock] if clock else []),
        )


def run_hf(args: argparse.Namespace, workload: Workload) -> RunResult:
    from transformers import AutoModelForCausalLM

    label = f"HF generate bs={args.hf_batch_size}"
    print(f"\n== {label}: loading", flush=True)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id or 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]

    warmup = [list(range(1, WARMUP_PROMPT_LEN + 1))] * WARMUP_NUM_REQUESTS
    _hf_generate(model, warmup, WARMUP_OUTPUT_LEN, pad_id, None)
    runs = []
    for _ in range(args.repeat):
        runs.append(time_hf_once(model, workload, args.hf_batch_size, pad_id, label))
        print_result(runs[-1])
    del model
    gc.collect()
    return fastest(runs)


def time_hf_once(
    model: Any, workload: Workload, batch_size: int, pad_id: int, label: str
) -> RunResult:
    """Requests in workload order, `batch_size` at a time; a batch runs until its longest output
    (min_new_tokens holds EOS off), but only each request's own output counts as useful."""
    ttft: list[float] = []
    batches = range(0, len(workload.prompts), batch_size)
    start, cpu_start = time.perf_counter(), time.process_time()
    for first in tqdm(batches, desc="hf", unit="batch"):
        prompts = workload.prompts[first : first + batch_size]
        clock = _FirstCallClock()
        num_new = max(workload.output_lens[first : first + batch_size])
        _hf_generate(model, prompts, num_new, pad_id, clock)
        assert clock.first_call_s is not None
        ttft += [clock.first_call_s - start] * len(prompts)
    total_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    return RunResult(
        label,
        len(workload.prompts),
        workload.num_input_tokens,
        workload.num_output_tokens,
        total_s,
        cpu_s,
        ttft,
    )


# ---- reporting -----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_result(r: RunResult) -> None:
    line = (
        f"{r.label}: {r.num_requests} reqs, {r.num_input_tokens} in + {r.num_output_tokens} out "
        f"tokens in {r.total_s:.2f} s (CPU {r.cpu_s:.1f} s) | output {r.output_tok_s:.1f} tok/s | "
        f"total {r.total_tok_s:.1f} tok/s | mean TTFT {_fmt(r.ttft_mean_ms, '.0f')} ms"
    )
    if r.cache_hit is not None:
        line += f" | prefix-cache hit {r.cache_hit:.1%}"
    print(line, flush=True)


def print_table(results: list[RunResult], workload: Workload) -> None:
    header = (
        f"{'run':<52} {'time s':>8} {'CPU s':>7} {'out tok/s':>10} {'total tok/s':>12} "
        f"{'TTFT mean ms':>13} {'TTFT p50 ms':>12} {'cache hit':>10}"
    )
    print(
        f"\n==== summary: {workload.name} workload, {len(workload.prompts)} requests, "
        f"{workload.num_input_tokens} input + {workload.num_output_tokens} output tokens, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        hit = "n/a" if r.cache_hit is None else f"{r.cache_hit:.1%}"
        print(
            f"{r.label:<52} {r.total_s:>8.2f} {r.cpu_s:>7.1f} "
            f"{r.output_tok_s:>10.1f} {r.total_tok_s:>12.1f} "
            f"{_fmt(r.ttft_mean_ms, '.0f'):>13} {_fmt(r.ttft_p50_ms, '.0f'):>12} {hit:>10}"
        )
    hf = [r for r in results if r.label.startswith("HF")]
    if hf:
        for r in results:
            if r is not hf[0]:
                speedup = r.output_tok_s / hf[0].output_tok_s
                print(f"speedup of {r.label} over {hf[0].label}: {speedup:.2f}x (output tok/s)")


# ---- CLI -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-requests", type=int, default=64, help="random workload")
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix workload")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--min-suffix-len", type=int, default=16)
    p.add_argument("--max-suffix-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="timed runs per config; keeps the fastest")
    # engine options (the LLM / ServerArgs fields of the same names)
    p.add_argument("--model", default=None, help="HF folder or hub id; default: bundled model")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="default: 8192 on CUDA, 1024 on CPU"
    )
    p.add_argument("--cache-type", choices=["radix", "naive"], default="radix")
    p.add_argument("--disable-overlap", action="store_true", help="the same as --overlap off")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--speculative-algorithm", choices=["ngram"], default=None)
    for name in ("num_draft_tokens", "ngram_min_match", "ngram_max_match"):  # the server's defaults
        default = getattr(ServerArgs, f"speculative_{name}")
        p.add_argument(f"--speculative-{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2"], default="auto")
    p.add_argument(
        "--cuda-graphs",
        choices=["default", "on", "off"],
        default="default",
        help="decode CUDA graphs (default: the engine's, on for CUDA)",
    )
    # modes
    p.add_argument("--via-generate", action="store_true", help="time LLM.generate (no TTFT)")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--compare", action="store_true", help="radix vs naive x overlap on vs off, fresh LLM each"
    )
    p.add_argument(
        "--gpu-matrix",
        action="store_true",
        help="each of --backends x overlap on/off x graphs on/off, fresh LLM each",
    )
    p.add_argument("--backends", default="flashinfer,triton", help="for --gpu-matrix")
    p.add_argument(
        "--decode-floor",
        action="store_true",
        help="batch-1 decode vs the weight-bandwidth floor, the workload vs its FLOP floor",
    )
    p.add_argument("--floor-prompt-len", type=int, default=64, help="--decode-floor batch 1")
    p.add_argument("--floor-output-len", type=int, default=128, help="--decode-floor batch 1")
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # isolated child runs
    args = p.parse_args(argv)
    if args.min_input_len > args.max_input_len or args.min_output_len > args.max_output_len:
        p.error("--min-* must not exceed --max-*")
    if args.min_suffix_len > args.max_suffix_len:
        p.error("--min-suffix-len must not exceed --max-suffix-len")
    return args


def configs_to_run(args: argparse.Namespace) -> tuple[EngineConfig, ...]:
    if args.compare:
        return COMPARE_CONFIGS
    if args.gpu_matrix:
        return tuple(
            EngineConfig(args.cache_type, overlap, backend, graphs)
            for backend in args.backends.split(",")
            for graphs in (True, False)
            for overlap in ("on", "off")
        )
    overlap = "off" if args.disable_overlap else args.overlap
    graphs = {"default": None, "on": True, "off": False}[args.cuda_graphs]
    return (EngineConfig(args.cache_type, overlap, args.attention_backend, graphs),)


def run_decode_floor(args: argparse.Namespace, workload: Workload) -> None:
    import decode_floor  # this folder (the script's own) is on sys.path

    config = configs_to_run(args)[0]
    print(f"\n== decode floor: {config.label}: loading", flush=True)
    llm = LLM(model=args.model, **engine_options(args, config))
    try:
        warm_up(llm)
        model_config = load_model_config(resolve_model_path(args.model))
        dtype = resolve_dtype(args.dtype, resolve_device("auto"))

        def run_workload() -> float:
            runs = [
                time_minisgl_once(llm, workload, config.label, False) for _ in range(args.repeat)
            ]
            for r in runs:
                print_result(r)
            return fastest(runs).total_s

        report = decode_floor.measure(
            llm,
            model_config,
            dtype,
            args.floor_prompt_len,
            args.floor_output_len,
            run_workload,
            [len(p) for p in workload.prompts],
            workload.output_lens,
        )
    finally:
        llm.shutdown()
    print("\n==== decode floor")
    for line in report.lines():
        print(line)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The engine logs its memory plan, attention backend and CUDA-graph capture at INFO.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    workload = build_workload(args)
    print(
        f"workload {workload.name}: {len(workload.prompts)} requests, "
        f"{workload.num_input_tokens} input tokens, {workload.num_output_tokens} output tokens"
    )
    if args.decode_floor:
        run_decode_floor(args, workload)
        return
    configs = configs_to_run(args)
    if args.gpu_matrix:
        # Each config in its own process (see run_isolated); the child prints its own lines.
        base = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--gpu-matrix"]
        results = [run_isolated(base, config) for config in configs]
    else:
        results = [run_minisgl(args, workload, config) for config in configs]
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(dataclasses.asdict(results[0])))
            return
    if args.hf:
        results.append(run_hf(args, workload))
    print_table(results, workload)


if __name__ == "__main__":
    main()
