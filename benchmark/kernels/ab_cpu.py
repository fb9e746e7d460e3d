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

from minisgl import LLM, SamplingParams
from minisgl.kernels import build
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.weights import PackedLinear

REPO = Path(__file__).resolve().parents[2]
CSRC = "minisgl/kernels/csrc"
sys.path.insert(0, str(REPO / "benchmark" / "offline"))
import bench_speculative as chats_workload  # noqa: E402


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
    llm: LLM,
    drafting: LLM,
    builds: dict[str, CpuKernels],
    rounds: int,
    workloads: list[str],
    concurrency: int,
) -> None:
    count = 2 if concurrency == 1 else concurrency
    groups = []
    for w in workloads:
        conversations = chats_workload.conversations(w, count)
        groups += [conversations[i : i + concurrency] for i in range(0, count, concurrency)]
    first, full = (
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=192),
    )
    engines = {"off": llm, "on": drafting}
    totals = {(name, on): [0, 0.0] for name in builds for on in engines}
    for e in engines.values():
        e.chat([chats_workload.WARM_UP_CHAT], first)
    for r in range(rounds):
        for group in groups:
            for name, k in builds.items():
                for on, e in engines.items():
                    use(e.scheduler.engine.model, k)
                    e.scheduler.flush_cache()
                    start = time.perf_counter()
                    e.chat(group, first)  # the prefill and first tokens, timed apart
                    prefill_s = time.perf_counter() - start
                    e.scheduler.flush_cache()
                    start = time.perf_counter()
                    outs = e.chat(group, full)
                    totals[name, on][0] += sum(len(o.token_ids) - 1 for o in outs)
                    totals[name, on][1] += time.perf_counter() - start - prefill_s
        cells = []
        for name in builds:
            off_tok_s, on_tok_s = (totals[name, o][0] / totals[name, o][1] for o in engines)
            cells.append(
                f"{name}: off {off_tok_s:6.1f} on {on_tok_s:6.1f} tok/s, "
                f"{on_tok_s / off_tok_s:.2f}x"
            )
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
    llm = LLM(args.model)
    try:
        if args.mode in ("matmuls", "both"):
            matmuls(llm, builds, args.rows, args.repeats)
        if args.mode in ("chats", "both"):
            with LLM(args.model, speculative_algorithm="ngram") as drafting:
                chats(llm, drafting, builds, args.rounds, args.workloads, args.concurrency)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
