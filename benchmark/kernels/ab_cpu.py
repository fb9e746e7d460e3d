"""A/B of two builds of the CPU kernels (minisgl/kernels/csrc) in one process, called in turn.

This VM's memory speed drifts up to 2x between minutes, so two runs minutes apart cannot compare
a kernel change of 10-20%; here both builds are loaded into one process (the library is named by
a hash of its sources: `--before REV`'s csrc from git, the working tree's as `after`) and each
measurement alternates between them, so drift hits both alike.

    python benchmark/kernels/ab_cpu.py --before HEAD~1                  # matmuls, then chats
    python benchmark/kernels/ab_cpu.py --before HEAD~1 --mode matmuls --rows 1 5 16
    python benchmark/kernels/ab_cpu.py --before HEAD~1 --mode chats --rounds 4
    python benchmark/kernels/ab_cpu.py --before HEAD~1 --mode chats --workloads story \
        --concurrency 16

`matmuls`: every linear weight of the model (the bundled Q4_1 SmolLM2 unless --model; its 121
matmuls including the head, weights from memory as in a decode step), one after the other at
each --rows, best of --repeats, ms per model pass (about 1 ms of it is ctypes calls); and whether
the two builds return the same bits. `chats`: benchmark/offline/bench_speculative.py's chats
(the copy-heavy ones unless --workloads; two per workload at batch 1, --concurrency at once
otherwise), greedy, drafts off and on, each group run with one build in every layer and the fused
decode step, then with the other; decode tok/s per build and the drafts' speedup.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minisgl import LLM
from minisgl.kernels import build
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.weights import PackedLinear

REPO = Path(__file__).resolve().parents[2]
CSRC = "minisgl/kernels/csrc"
sys.path.insert(0, str(REPO / "benchmark" / "offline"))
import bench_speculative as chats_workload  # noqa: E402

MAX_TOKENS = 192  # as bench_speculative.py's default


def library(source_dir: Path) -> CpuKernels:
    """The kernels built from `source_dir` (cached by a hash of the sources, as every build)."""
    default, build.SOURCE_DIR = build.SOURCE_DIR, source_dir
    try:
        return CpuKernels(ctypes.CDLL(str(build.build_library())))
    finally:
        build.SOURCE_DIR = default


def build_of(rev: str) -> CpuKernels:
    """The kernels as of git revision `rev` (its csrc exported to a temporary folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, CSRC], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        return library(Path(tmp) / CSRC)


def use(model: torch.nn.Module, kernels: CpuKernels) -> None:
    """Every layer of `model` and its fused decode step on `kernels`."""
    for module in model.modules():
        if getattr(module, "_kernels", None) is not None:
            setattr(module, "_kernels", kernels)  # noqa: B010 (a private slot of the layers)
    if (stack := getattr(model, "cpu_decode_stack", None)) is not None:
        stack.kernels = kernels


def matmuls(llm: LLM, builds: dict[str, CpuKernels], rows: list[int], repeats: int) -> None:
    model = llm.scheduler.engine.model
    found = [getattr(m, "packed", None) for m in model.modules()]
    # (a tied head shares the embedding's)
    weights = list({id(w): w for w in found if isinstance(w, PackedLinear)}.values())
    print(f"{len(weights)} weights; ms per pass over all of them (best of {repeats})")
    for m in rows:
        xs = [torch.randn(m, w.in_features) for w in weights]
        best = dict.fromkeys(builds, float("inf"))
        outs: dict[str, list[torch.Tensor]] = {}
        for _ in range(repeats):
            for name, k in builds.items():
                start = time.perf_counter()
                outs[name] = [k.linear(x, w) for x, w in zip(xs, weights, strict=True)]
                best[name] = min(best[name], time.perf_counter() - start)
        a, b = outs.values()
        same = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        cells = "  ".join(f"{name} {s * 1e3:7.2f}" for name, s in best.items())
        print(f"rows {m:3d}: {cells}   same bits: {'yes' if same else 'no'}", flush=True)


def chats(
    engines: dict[str, chats_workload.OfflineEngine],
    builds: dict[str, CpuKernels],
    rounds: int,
    workloads: list[str],
    concurrency: int,
) -> None:
    """bench_speculative.py's runs (its timing: the prefill and first tokens run apart), each
    group of chats on every build and engine in turn."""
    count = 2 if concurrency == 1 else concurrency
    groups = []
    for w in workloads:
        conversations = chats_workload.conversations(w, count)
        groups += [conversations[i : i + concurrency] for i in range(0, count, concurrency)]
    totals: dict[tuple[str, str], chats_workload.Timing] = {}
    for r in range(rounds):
        for group in groups:
            for name, k in builds.items():
                for drafts, engine in engines.items():
                    use(engine.llm.scheduler.engine.model, k)
                    timing, _ = chats_workload.run_batches(engine, group, MAX_TOKENS, len(group))
                    key = (name, drafts)
                    totals[key] = totals[key] + timing if key in totals else timing
        cells = []
        for name in builds:
            off, on = (totals[name, drafts].decode_tok_s for drafts in engines)
            cells.append(f"{name}: off {off:6.1f} on {on:6.1f} tok/s, {on / off:.2f}x")
        print(f"after {r + 1} rounds: " + " | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--before", required=True, help="git revision of the build to compare with")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--mode", choices=("matmuls", "chats", "both"), default="both")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 20])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="chats: times through the chats")
    p.add_argument(
        "--workloads", nargs="+", choices=chats_workload.WORKLOADS,
        default=list(chats_workload.COPY_HEAVY), help="chats: bench_speculative.py's",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=1, help="chats: requests at once")
    args = p.parse_args()
    torch.manual_seed(0)
    builds = {"before": build_of(args.before), "after": library(REPO / CSRC)}
    engines = {"off": chats_workload.OfflineEngine(args.model, {})}
    try:
        if args.mode in ("matmuls", "both"):
            matmuls(engines["off"].llm, builds, args.rows, args.repeats)
        if args.mode in ("chats", "both"):
            engines["on"] = chats_workload.OfflineEngine(
                args.model, {"speculative_algorithm": "ngram"}
            )
            chats(engines, builds, args.rounds, args.workloads, args.concurrency)
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
