"""Peer check: minisgl against Mini-SGLang on the same checkpoint, prompts and output lengths.

Mini-SGLang's Python package is also named `minisgl`, so each engine runs in a process of its
own: ours with this repository first on sys.path, theirs with its source root first and no
folder holding our package anywhere on it. The workload is bench.py's random one (the same
function, seed and flags; Mini-SGLang's offline benchmark by default: 256 requests, input and
output lengths uniform in 100..1024, ignore_eos, greedy); the driver builds it once and hands
both children the same token ids. Each child loads its engine, runs an untimed warm-up, times
one run of the workload and writes a JSON result; the driver prints one table last.

    python benchmark/offline/peer.py --compare --model /tmp/qwen3-0.6b --peer-path .peer/mini-sglang
    python benchmark/offline/peer.py --engine minisgl --model /tmp/qwen3-0.6b --json ours.json
    python benchmark/offline/peer.py --engine mini-sglang --peer-path .peer/mini-sglang \\
        --model /tmp/qwen3-0.6b --workload-file workload.json --json theirs.json

Mini-SGLang runs with attention_backend="fi" (FlashInfer) and the settings of its own offline
benchmark (page size 256, 16384 prefill tokens, 4096 max sequence length; CUDA graphs up to
batch 256, its default on a GPU with over 80 GiB free); overlap scheduling is its default: on
unless MINISGL_DISABLE_OVERLAP_SCHEDULING is set, a variable both engines read. It needs CUDA;
scripts/peer_check.sh runs this on the device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # this repository: our `minisgl` package lives here
ENGINES = ("minisgl", "mini-sglang")  # ours first: it starts fast, the peer gets what is left
PEER = "mini-sglang"
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4
WARMUP_NUM_REQUESTS = 2
CHILD_TIMEOUT_S = 600
MIN_CHILD_S = 30  # a child given less is not started


# ---- the workload (bench.py's) -------------------------------------------------------------------


def bench_argv(args: argparse.Namespace) -> list[str]:
    """bench.py's flags for this workload and our engine options."""
    argv = [
        "--workload=random",
        f"--num-requests={args.num_requests}",
        f"--min-input-len={args.min_input_len}",
        f"--max-input-len={args.max_input_len}",
        f"--min-output-len={args.min_output_len}",
        f"--max-output-len={args.max_output_len}",
        f"--seed={args.seed}",
        f"--page-size={args.page_size}",
        f"--attention-backend={args.attention_backend}",
        f"--overlap={args.overlap}",
        f"--cuda-graphs={args.cuda_graphs}",
    ]
    if args.model is not None:
        argv.append(f"--model={args.model}")
    if args.max_prefill_tokens is not None:
        argv.append(f"--max-prefill-tokens={args.max_prefill_tokens}")
    if args.num_pages is not None:
        argv.append(f"--num-pages={args.num_pages}")
    return argv


def _bench() -> Any:
    """bench.py (imports our `minisgl`: never call this in the Mini-SGLang child)."""
    sys.path.insert(0, str(HERE))
    import bench

    return bench


def build_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    bench = _bench()
    workload = bench.build_workload(bench.parse_args(bench_argv(args)))
    return workload.prompts, workload.output_lens


def workload_digest(prompts: list[list[int]], output_lens: list[int]) -> str:
    text = json.dumps([prompts, output_lens], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_workload(path: Path, prompts: list[list[int]], output_lens: list[int]) -> None:
    path.write_text(json.dumps({"prompts": prompts, "output_lens": output_lens}))


def read_workload(path: str) -> tuple[list[list[int]], list[int]]:
    data = json.loads(Path(path).read_text())
    return data["prompts"], data["output_lens"]


def result(
    engine: str, settings: str, seconds: float, prompts: list[list[int]], output_lens: list[int]
) -> dict[str, Any]:
    num_output_tokens = sum(output_lens)
    return {
        "engine": engine,
        "settings": settings,
        "seconds": seconds,
        "num_requests": len(prompts),
        "num_input_tokens": sum(len(p) for p in prompts),
        "num_output_tokens": num_output_tokens,
        "output_tok_s": num_output_tokens / seconds,
        "workload_digest": workload_digest(prompts, output_lens),
    }


# ---- minisgl (ours) ------------------------------------------------------------------------------


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # our engine's "auto" device


def run_minisgl(args: argparse.Namespace) -> dict[str, Any]:
    bench = _bench()
    bench_args = bench.parse_args(bench_argv(args))
    if args.workload_file:
        prompts, output_lens = read_workload(args.workload_file)
    else:
        prompts, output_lens = build_workload(args)
    workload = bench.Workload("random", prompts, output_lens)
    config = bench.configs_to_run(bench_args)[0]
    start = time.perf_counter()
    llm = bench.LLM(model=args.model, **bench.engine_options(bench_args, config))
    try:
        bench.warm_up(llm)
        startup_s = time.perf_counter() - start
        run = bench.time_minisgl_once(llm, workload, config.label, via_generate=False)
        prefill = llm.args.resolved_max_prefill_tokens(_device_type())
    finally:
        llm.shutdown()
    settings = f"{config.label.removeprefix('minisgl ')}, page {args.page_size}, prefill {prefill}"
    out = result("minisgl", settings, run.total_s, prompts, output_lens)
    import minisgl

    return {**out, "startup_s": startup_s, "package": str(Path(minisgl.__file__).parent)}


# ---- Mini-SGLang (the peer) ----------------------------------------------------------------------


def peer_package_root(peer_path: str | Path) -> Path:
    """The folder that holds Mini-SGLang's `minisgl` package (its source keeps it in python/)."""
    path = Path(peer_path).resolve()
    return path / "python" if (path / "python" / "minisgl").is_dir() else path


def isolated_path(entries: list[str], peer_root: Path) -> list[str]:
    """`entries` with `peer_root` first and every other folder holding a `minisgl` (ours, or an
    installed one) dropped. Their `minisgl` is a namespace package (no __init__.py): a regular
    package later on the path would still win the import, so none may remain."""
    kept = []
    for entry in entries:
        folder = Path(entry or os.getcwd()).resolve()
        if folder != peer_root and not (folder / "minisgl").exists():
            kept.append(entry)
    return [str(peer_root), *kept]


def import_peer(peer_root: Path) -> Any:
    """Import Mini-SGLang's `minisgl` and check it is theirs."""
    sys.path[:] = isolated_path(sys.path, peer_root)
    if "minisgl" in sys.modules:
        raise RuntimeError("a `minisgl` package was imported before the peer's")
    import minisgl

    locations = [Path(p).resolve() for p in minisgl.__path__]
    if not all(loc.is_relative_to(peer_root) for loc in locations):
        raise RuntimeError(f"imported minisgl from {locations}, not from {peer_root}")
    return minisgl


def peer_options(args: argparse.Namespace) -> dict[str, Any]:
    """Mini-SGLang's LLM keyword arguments (its EngineConfig / SchedulerConfig fields)."""
    options: dict[str, Any] = {
        "attention_backend": "fi",
        "page_size": args.peer_page_size,
        "max_extend_tokens": args.peer_max_extend_tokens,
        "max_seq_len_override": args.peer_max_seq_len,
        "cuda_graph_max_bs": args.peer_cuda_graph_max_bs,
    }
    return {k: v for k, v in options.items() if v is not None}


def _peer_settings(llm: Any, options: dict[str, Any]) -> str:
    """What the peer engine ran with, read back from it where it says (graphs, overlap)."""
    from minisgl.env import ENV  # theirs

    runner = getattr(getattr(llm, "engine", None), "graph_runner", None)
    graph_bs = getattr(runner, "max_graph_bs", None)
    graphs = "graphs ?" if graph_bs is None else f"graphs {'on' if graph_bs else 'off'}"
    overlap = "off" if ENV.DISABLE_OVERLAP_SCHEDULING else "on"
    return (
        f"{options['attention_backend']} {graphs} (bs<={graph_bs}) overlap={overlap}, radix, "
        f"page {options.get('page_size', 1)}, prefill {getattr(llm, 'prefill_budget', '?')}"
    )


def run_mini_sglang(args: argparse.Namespace) -> dict[str, Any]:
    if not args.workload_file:
        raise SystemExit(
            "--engine mini-sglang needs --workload-file (the driver, --compare, writes it)"
        )
    peer_root = peer_package_root(args.peer_path)
    package = import_peer(peer_root)
    from minisgl.core import SamplingParams  # theirs
    from minisgl.llm import LLM  # theirs

    prompts, output_lens = read_workload(args.workload_file)
    options = peer_options(args)
    start = time.perf_counter()
    llm = LLM(args.model, **options)  # bf16, its default dtype
    warmup = [list(range(1, WARMUP_PROMPT_LEN + 1))] * WARMUP_NUM_REQUESTS
    llm.generate(warmup, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True))
    startup_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    received = [len(out["token_ids"]) for out in outputs]
    short = [
        (i, n, want)
        for i, (n, want) in enumerate(zip(received, output_lens, strict=True))
        if n < want
    ]
    if short:
        raise RuntimeError(f"{len(short)} requests got fewer tokens than asked, e.g. {short[:3]}")
    out = result(PEER, _peer_settings(llm, options), seconds, prompts, output_lens)
    try:
        llm.shutdown()
    except Exception as exc:  # the figures are in: a failed tear-down only gets a note
        print(f"Mini-SGLang shutdown failed: {exc!r}", flush=True)
    return {
        **out,
        "startup_s": startup_s,
        "received_output_tokens": sum(received),  # more than asked: tokens past the end
        "package": [str(p) for p in package.__path__],
    }


# ---- the driver ----------------------------------------------------------------------------------


def child_argv(args: argparse.Namespace, engine: str, json_path: Path, workload: Path) -> list[str]:
    argv = [str(Path(__file__).resolve()), f"--engine={engine}", f"--json={json_path}"]
    argv += [f"--workload-file={workload}", f"--peer-path={Path(args.peer_path).resolve()}"]
    argv += [a for a in bench_argv(args) if a != "--workload=random"]
    for name in ("peer_page_size", "peer_max_extend_tokens", "peer_max_seq_len"):
        argv.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    if args.peer_cuda_graph_max_bs is not None:
        argv.append(f"--peer-cuda-graph-max-bs={args.peer_cuda_graph_max_bs}")
    return argv


def child_env(engine: str, peer_path: str | Path, env: dict[str, str]) -> dict[str, str]:
    """The child's environment: PYTHONPATH with our repository first (ours) or with the peer's
    source root first and no folder holding a `minisgl` (theirs)."""
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    if engine == PEER:
        entries = isolated_path(entries, peer_package_root(peer_path))
    else:
        entries = [str(ROOT), *(e for e in entries if Path(e).resolve() != ROOT)]
    return {**env, "PYTHONPATH": os.pathsep.join(entries)}


def run_child(
    args: argparse.Namespace, engine: str, tmp: Path, workload: Path, timeout_s: float
) -> dict[str, Any]:
    if timeout_s < MIN_CHILD_S:
        return {"engine": engine, "settings": "SKIPPED (no time left)", "seconds": None}
    json_path = tmp / f"{engine}.json"
    command = [sys.executable, *child_argv(args, engine, json_path, workload)]
    # Theirs runs outside this repository, so not even the working folder leads to our package.
    cwd = ROOT if engine != PEER else tmp
    print(f"\n== {engine}: {' '.join(command)}", flush=True)
    try:
        proc = subprocess.run(
            command, cwd=cwd, env=child_env(engine, args.peer_path, dict(os.environ)),
            timeout=timeout_s, check=False,
        )  # fmt: skip
        failure = f"exit {proc.returncode}" if proc.returncode != 0 else None
    except subprocess.TimeoutExpired:
        failure = f"timed out after {timeout_s:.0f} s"
    if failure is None and json_path.exists():
        return json.loads(json_path.read_text())
    return {"engine": engine, "settings": f"FAILED ({failure or 'no result'})", "seconds": None}


def table(results: list[dict[str, Any]]) -> list[str]:
    """engine, settings, seconds, output tok/s, ratio (minisgl / Mini-SGLang output tok/s)."""
    by_engine = {r["engine"]: r for r in results}
    peer_rate = by_engine.get(PEER, {}).get("output_tok_s")
    width = max([len("settings")] + [len(r["settings"]) for r in results])
    header = f"{'engine':<12} {'settings':<{width}} {'seconds':>8} {'out tok/s':>10} {'ratio':>6}"
    lines = [header, "-" * len(header)]
    for r in results:
        ok = r.get("seconds") is not None
        seconds = f"{r['seconds']:.2f}" if ok else "-"
        rate = f"{r['output_tok_s']:.0f}" if ok else "-"
        ratio = "-"
        if ok and r["engine"] != PEER and peer_rate:
            ratio = f"{r['output_tok_s'] / peer_rate:.2f}"
        elif ok and r["engine"] == PEER:
            ratio = "1.00"
        lines.append(
            f"{r['engine']:<12} {r['settings']:<{width}} {seconds:>8} {rate:>10} {ratio:>6}"
        )
    return lines


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts, output_lens = build_workload(args)
    digest = workload_digest(prompts, output_lens)
    deadline = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
    results = []
    with tempfile.TemporaryDirectory(prefix="minisgl_peer_") as tmp_name:
        tmp = Path(tmp_name)
        workload = tmp / "workload.json"
        write_workload(workload, prompts, output_lens)
        for engine in args.engines.split(","):
            timeout_s = min(args.child_timeout_s, deadline - time.monotonic())
            results.append(run_child(args, engine, tmp, workload, timeout_s))
    for r in results:
        if r.get("seconds") is not None and r["workload_digest"] != digest:
            r["settings"] += " (OTHER WORKLOAD)"
    print(
        f"\n==== peer check: {len(prompts)} requests, {sum(map(len, prompts))} input + "
        f"{sum(output_lens)} output tokens (ignore_eos, greedy), workload {digest}, "
        f"model {args.model}"
    )
    for line in table(results):
        print(line)
    return results


# ---- CLI -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--engine", choices=ENGINES, help="run one engine in this process")
    mode.add_argument("--compare", action="store_true", help="each engine in a fresh process")
    p.add_argument("--engines", default=",".join(ENGINES), help="for --compare, in this order")
    p.add_argument("--peer-path", default=str(ROOT / ".peer" / "mini-sglang"))
    p.add_argument("--model", required=True, help="an HF checkpoint folder both engines load")
    p.add_argument("--json", default=None, help="write the result(s) here")
    p.add_argument("--workload-file", default=None, help="token ids to run (the driver's)")
    p.add_argument("--child-timeout-s", type=float, default=CHILD_TIMEOUT_S, help="per engine")
    p.add_argument("--budget-s", type=float, default=None, help="for all engines together")
    # bench.py's workload flags; defaults: Mini-SGLang's offline benchmark
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    # ours (bench.py's names); defaults: the best GPU config
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--attention-backend", default="flashinfer")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="on")
    p.add_argument("--cuda-graphs", choices=["default", "on", "off"], default="on")
    # theirs; defaults: its offline benchmark's (None: its engine's default)
    p.add_argument("--peer-page-size", type=int, default=256)
    p.add_argument("--peer-max-extend-tokens", type=int, default=16384)
    p.add_argument("--peer-max-seq-len", type=int, default=4096)
    p.add_argument("--peer-cuda-graph-max-bs", type=int, default=None)
    args = p.parse_args(argv)
    if args.min_input_len > args.max_input_len or args.min_output_len > args.max_output_len:
        p.error("--min-* must not exceed --max-*")
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engine(s) in --engines: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        results: Any = compare(args)
    else:
        results = run_minisgl(args) if args.engine == "minisgl" else run_mini_sglang(args)
        print(f"{args.engine}: {results['seconds']:.2f} s, {results['output_tok_s']:.0f} out tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
