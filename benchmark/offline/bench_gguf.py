"""minisgl against llama.cpp's server on the same GGUF files, alternating, through one client.

One command builds what is missing and prints the table issue 43 asks for (llama.cpp vs minisgl):

    python benchmark/offline/bench_gguf.py --llama-cpp ~/llama.cpp --rounds 2

- llama.cpp: `--llama-cpp` is a llama.cpp source tree (e.g. the one vendored in the
  llama-cpp-python sdist); `llama-server` and `llama-quantize` are built there with cmake
  (CPU only, -march=native) unless `build/bin` has them. Its `convert_hf_to_gguf.py` converts
  the checkpoints (it needs `pip install sentencepiece`; its own gguf-py is put on PYTHONPATH).
- Files (`--files`, default: Qwen3-0.6B's and Qwen3-1.7B's shapes as Q4_K_M and Q8_0, then the
  bundled SmolLM2-135M Q4_1): random checkpoints of the real models' exact shapes
  (scripts/make_random_checkpoint.py, bf16, the Qwen3 tokenizer) under `--models-dir`, converted
  with `--outtype f16` / `q8_0` and quantized with `llama-quantize F16 OUT Q4_K_M`; each step
  only if its output is missing.
- Servers: `python -m minisgl.server --model FILE` (its defaults, plus a bf16 KV pool of
  --kv-tokens tokens and --minisgl-args) and `llama-server -m FILE -t T -tb T -np 16 -c
  KV_TOKENS --kv-unified` (plus --llama-args), both up at once, each measurement on one then
  the other (the machine's speed drifts between minutes).
- Per round and server: batch-1 decode (--decode-tokens greedy tokens after a ~60-token prompt,
  EOS ignored; tok/s after the first token); concurrency 8 and 16 (bench_serving.py's random
  chats, 2 x concurrency prompts of 160 words +-50%, 128 output tokens +-50%, temperature 0.7;
  new prompts every round, the same for both servers): output tok/s and median TTFT; TTFT of a
  fresh --prefill-tokens-word prompt (one output token). Last, each server's resident memory
  (VmRSS; minisgl's scheduler process) at the same KV capacity, and what its KV pool holds.
Every figure is the median over rounds, with minisgl / llama.cpp beside it.

`--kernels 1,8,16 --gguf FILE` instead times the linear op alone on the file's weights (every
layer's projections and the LM head, as minisgl merges them), one thread, process CPU time
(steady under other load), best of 5, per GGUF type; with fp32 activations and, alternating
pass by pass where the CPU has it, int8 ones (MINISGL_INT8_ACTIVATIONS=1). `--int8-ab --gguf
FILE` decodes offline at batch 1 and prefills a fresh --prefill-tokens-word prompt with fp32
and int8 activations alternating (--rounds), then prints how far greedy tokens agree and how
much the docs' prompt logprobs move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ONLINE = HERE.parent / "online"
sys.path.insert(0, str(ONLINE))

from bench_common import RequestSpec, build_payload, send_request  # noqa: E402
from bench_serving import WORDS  # noqa: E402

from minisgl.models.default_model import default_model_gguf  # noqa: E402

READY_TIMEOUT_S = 900.0
BUNDLED = "smollm2-135m:Q4_1"
DEFAULT_FILES = "qwen3-0.6b:Q4_K_M,qwen3-0.6b:Q8_0,qwen3-1.7b:Q4_K_M,qwen3-1.7b:Q8_0," + BUNDLED
DECODE_PROMPT = " ".join(["The history of the city of Paris began on an island in the Seine."] * 4)
CONCURRENCY = (8, 16)
LLAMA_TARGETS = ("llama-server", "llama-quantize")
CONVERTER_TYPES = {"Q8_0": "q8_0", "F16": "f16"}  # what convert_hf_to_gguf.py writes itself


def workload(concurrency: int) -> list[str]:
    """bench_serving.py's flags for RESULTS.md section 10's chats at `concurrency`."""
    return [
        "--dataset",
        "random",
        "--num-prompts",
        str(2 * concurrency),
        "--max-concurrency",
        str(concurrency),
        "--random-input-len",
        "160",
        "--random-range-ratio",
        "0.5",
        "--random-output-len",
        "128",
        "--ignore-eos",
        "--temperature",
        "0.7",
        "--num-warmup",
        "1",
        "--disable-tqdm",
    ]


# ---- llama.cpp and the files -------------------------------------------------------------------
def llama_binaries(source: Path) -> Path:
    """The folder of llama-server and llama-quantize, built in `source` if missing."""
    bin_dir = source / "build" / "bin"
    if all((bin_dir / t).exists() for t in LLAMA_TARGETS):
        return bin_dir
    configure = ["cmake", "-S", str(source), "-B", str(source / "build")]
    configure += ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
    configure += ["-DGGML_CUDA=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    build = ["cmake", "--build", str(source / "build"), "-j", str(os.cpu_count() or 1)]
    print(f"building llama.cpp in {source}/build (minutes)", flush=True)
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*build, "--target", *LLAMA_TARGETS], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def gguf_file(spec: str, models_dir: Path, source: Path | None, bin_dir: Path | None) -> Path:
    """The file for `preset:TYPE` (the bundled one for BUNDLED), made now if missing."""
    if spec == BUNDLED:
        return default_model_gguf()
    preset, qtype = spec.split(":")
    out = models_dir / f"{preset}-{qtype}.gguf"
    if out.exists():
        return out
    if source is None or bin_dir is None:
        raise SystemExit(f"{out} is missing: making it needs --llama-cpp")
    checkpoint = models_dir / f"{preset}-random"
    if not (checkpoint / "config.json").exists():
        script = REPO / "scripts" / "make_random_checkpoint.py"
        subprocess.run(
            [sys.executable, str(script), str(checkpoint), "--preset", preset], check=True
        )
    if qtype in CONVERTER_TYPES:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(source / "gguf-py"), env.get("PYTHONPATH")])
        )
        convert = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(checkpoint)]
        convert += ["--outtype", CONVERTER_TYPES[qtype], "--outfile", str(out)]
        subprocess.run(convert, check=True, env=env, stdout=subprocess.DEVNULL)
    else:  # llama-quantize refuses to requantize a q8_0 file: from f16
        f16 = gguf_file(f"{preset}:F16", models_dir, source, bin_dir)
        subprocess.run(
            [str(bin_dir / "llama-quantize"), str(f16), str(out), qtype],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


# ---- servers -----------------------------------------------------------------------------------
def start(name: str, cmd: list[str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the server)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: Collection[subprocess.Popen]) -> None:
    """Every server asked to stop first, then each waited for: they shut down side by side."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def largest_rss_mb(pid: int) -> float:
    """The scheduler holds the model: the largest resident process of the server's tree."""
    return max(rss_mb(p) for p in descendants(pid) if Path(f"/proc/{p}").exists())


def servers(file: Path, args: argparse.Namespace, bin_dir: Path | None) -> dict[str, list[str]]:
    minisgl = [sys.executable, "-m", "minisgl.server", "--model", str(file)]
    minisgl += ["--num-pages", str(args.kv_tokens), "--port", str(args.port)]
    minisgl += ["--kv-cache-dtype", "bf16"]  # llama.cpp's default K/V is f16: the same bytes/token
    out = {"minisgl": minisgl + shlex.split(args.minisgl_args)}
    if bin_dir is not None:
        threads = str(args.threads)
        out["llama.cpp"] = [
            str(bin_dir / "llama-server"),
            "-m",
            str(file),
            "-t",
            threads,
            "-tb",
            threads,
            "-np",
            "16",
            "-c",
            str(args.kv_tokens),
            "--kv-unified",
            "--port",
            str(args.port + 1),
            *shlex.split(args.llama_args),
        ]
    return out


# ---- measurements ------------------------------------------------------------------------------
async def first_tokens(url: str, model: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s after the first token) of one greedy streamed completion."""
    body = build_payload(RequestSpec(prompt, tokens), model, "completions", True, 0.0)
    async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as client:
        result = await send_request(client, url + "/v1/completions", body, tokens)
    if not result.ok:
        raise RuntimeError(f"{url}: {result.error or 'no tokens'}")
    return result.ttft_s, 1.0 / result.tpot_s if result.tpot_s else float("nan")


def chats(url: str, concurrency: int, seed: int) -> tuple[float, float]:
    """(output tok/s, median TTFT s) of bench_serving.py's chats at `concurrency`."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as out:
        path = out.name
    cmd = [sys.executable, str(ONLINE / "bench_serving.py"), "--base-url", url]
    cmd += [*workload(concurrency), "--seed", str(seed), "--output-file", path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    record = json.loads(Path(path).read_text().splitlines()[-1])
    os.unlink(path)
    if record.get("failed"):
        raise RuntimeError(f"{url}: {record['failed']} requests failed: {record.get('errors')}")
    return float(record["output_throughput"]), float(record["p50_ttft_ms"]) / 1e3


def long_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def measure_file(file: Path, args: argparse.Namespace, bin_dir: Path | None) -> dict:
    """Every figure of one file, per server: lists over rounds, and the RSS."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench_gguf-"))
    cmds = servers(file, args, bin_dir)
    procs = {name: start(name, cmd, log_dir) for name, cmd in cmds.items()}
    urls = {n: f"http://127.0.0.1:{c[c.index('--port') + 1]}" for n, c in cmds.items()}
    figures: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in cmds}
    try:
        for name, url in urls.items():
            wait_ready(url, procs[name])
        models = {n: httpx.get(u + "/v1/models").json()["data"][0]["id"] for n, u in urls.items()}
        for name, url in urls.items():  # warm-up: first-use costs out of the figures
            asyncio.run(first_tokens(url, models[name], DECODE_PROMPT, 8))
        for r in range(args.rounds):
            prompt = long_prompt(args.prefill_tokens, seed=1000 + r)
            for name, url in urls.items():
                f = figures[name]
                _, rate = asyncio.run(
                    first_tokens(url, models[name], DECODE_PROMPT, args.decode_tokens)
                )
                f["decode tok/s"].append(rate)
                for c in CONCURRENCY if not args.no_workload else ():
                    tok_s, ttft_s = chats(url, c, seed=r)
                    f[f"c{c} out tok/s"].append(tok_s)
                    f[f"c{c} median TTFT s"].append(ttft_s)
                ttft_s, _ = asyncio.run(first_tokens(url, models[name], prompt, 1))
                f[f"TTFT {args.prefill_tokens} words s"].append(ttft_s)
                cells = ", ".join(f"{k} {v[-1]:.2f}" for k, v in f.items())
                print(f"  round {r}: {name}: {cells}", flush=True)
        for name, proc in procs.items():
            figures[name]["RSS MB"] = [largest_rss_mb(proc.pid)]
    finally:
        stop(procs.values())
    print(f"  (load average {os.getloadavg()[0]:.2f}; logs in {log_dir})")
    return figures


def print_table(results: dict[str, dict]) -> None:
    # the ratio says how many times better minisgl does: for times and memory llama.cpp / minisgl
    print("\n| file | figure | llama.cpp | minisgl | ratio (> 1: minisgl better) |")
    print("|---|---|---:|---:|---:|")
    for file, figures in results.items():
        ours = figures["minisgl"]
        theirs = figures.get("llama.cpp", {})
        for i, key in enumerate(ours):
            a = statistics.median(ours[key])
            b = statistics.median(theirs[key]) if key in theirs else float("nan")
            ratio = b / a if key.endswith(" s") or key == "RSS MB" else a / b
            name = file if i == 0 else ""
            print(f"| {name} | {key} | {b:.2f} | {a:.2f} | {ratio:.2f}x |")


# ---- the linear op alone -----------------------------------------------------------------------
def kernel_times(gguf: Path, batches: list[int]) -> None:
    """The file's matmuls (projections merged as minisgl merges them), one thread, blocks."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader

    from minisgl.kernels import cpu
    from minisgl.kernels.weights import PackedLinear, QuantTensor

    kernels = cpu.get()
    assert kernels is not None
    torch.set_num_threads(1)
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}

    def part(name: str) -> QuantTensor:
        t = tensors[name]
        return QuantTensor(int(t.tensor_type), torch.from_numpy(np.array(t.data)), int(t.shape[0]))

    groups = {
        "qkv": ("attn_q", "attn_k", "attn_v"),
        "o": ("attn_output",),
        "gate_up": ("ffn_gate", "ffn_up"),
        "down": ("ffn_down",),
    }
    weights = []
    layers = sum(1 for n in tensors if n.endswith(".attn_q.weight"))
    for layer in range(layers):
        for group, names in groups.items():
            parts = [part(f"blk.{layer}.{n}.weight") for n in names]
            weights.append((group, parts))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    weights.append(("head", [part(head)]))
    packed = [(g, p, PackedLinear.of_blocks(dict(enumerate(p)))) for g, p in weights]
    paths = ["fp32", "int8"] if kernels.set_int8_activations(True) else ["fp32"]
    alternating = " and ".join(paths)
    print(f"{gguf.name}: {len(packed)} matmuls, one thread, ms per pass (best of 5; {alternating})")
    for batch in batches:
        xs = {w.in_features: torch.randn(batch, w.in_features) for _, _, w in packed}
        best: dict[tuple[str, str], float] = defaultdict(lambda: float("inf"))
        for _ in range(5):
            for path in paths:
                kernels.set_int8_activations(path == "int8")
                spent: dict[str, float] = defaultdict(float)
                for group, parts, w in packed:
                    start = time.process_time()
                    kernels.linear(xs[w.in_features], w)
                    seconds = time.process_time() - start
                    types = "+".join(sorted({GGMLQuantizationType(p.qtype).name for p in parts}))
                    for key in (group, types, "total"):
                        spent[key] += seconds
                for key, seconds in spent.items():
                    best[path, key] = min(best[path, key], seconds)
        for path in paths:
            row = ", ".join(f"{k} {v * 1e3:.1f}" for (p, k), v in best.items() if p == path)
            print(f"batch {batch} {path}: {row}")
    kernels.set_int8_activations(False)


def int8_ab(gguf: Path, rounds: int, decode_tokens: int, prefill_words: int) -> None:
    """Offline batch-1 decode and a fresh prefill of `prefill_words` words, with fp32 and int8
    activations alternating in one process (the switch is process-wide), then what int8
    changes: greedy tokens and prompt logprobs."""
    from minisgl.core import SamplingParams
    from minisgl.kernels import cpu
    from minisgl.llm import LLM

    kernels = cpu.get()
    assert kernels is not None and kernels.set_int8_activations(True), "no int8 path here"
    greedy = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    texts = (REPO / "docs" / "architecture.md").read_text().split("\n\n")
    texts = [p for p in texts if 400 < len(p) < 2000][:6]
    rates: dict[str, list[float]] = defaultdict(list)
    prefills: dict[str, list[float]] = defaultdict(list)
    tokens, logprobs = {}, {}
    with LLM(str(gguf)) as llm:
        for r in range(rounds):
            for path in ("fp32", "int8"):
                kernels.set_int8_activations(path == "int8")
                llm.scheduler.flush_cache()
                start = time.perf_counter()
                llm.generate([long_prompt(prefill_words, seed=1000 + r)], first)
                prefills[path].append(time.perf_counter() - start)
                llm.scheduler.flush_cache()  # both runs prefill the prompt
                start = time.perf_counter()
                llm.generate([DECODE_PROMPT], first)
                prefill_s = time.perf_counter() - start
                llm.scheduler.flush_cache()
                start = time.perf_counter()
                out = llm.generate([DECODE_PROMPT], greedy)[0]
                decode_s = time.perf_counter() - start - prefill_s
                rates[path].append((decode_tokens - 1) / decode_s)
                tokens[path] = out.token_ids
        for path in ("fp32", "int8"):
            kernels.set_int8_activations(path == "int8")
            llm.scheduler.flush_cache()
            scored = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0))
            logprobs[path] = [p.logprob for out in scored for p in out.prompt_logprobs if p]
    kernels.set_int8_activations(False)
    for path, values in rates.items():
        print(f"{path}: batch-1 decode tok/s per round " + ", ".join(f"{v:.1f}" for v in values))
        print(
            f"{path}: {prefill_words}-word prefill s per round "
            + ", ".join(f"{v:.2f}" for v in prefills[path])
        )
    pairs = enumerate(zip(tokens["fp32"], tokens["int8"], strict=True))
    same = next((i for i, (a, b) in pairs if a != b), decode_tokens)
    diffs = [abs(a - b) for a, b in zip(logprobs["fp32"], logprobs["int8"], strict=True)]
    mean = {p: sum(v) / len(v) for p, v in logprobs.items()}
    print(f"greedy: the first {same} of {decode_tokens} tokens equal")
    print(
        f"prompt logprobs of {len(diffs)} doc tokens: mean fp32 {mean['fp32']:.4f}, int8"
        f" {mean['int8']:.4f}; |difference| mean {sum(diffs) / len(diffs):.4f},"
        f" max {max(diffs):.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp source tree")
    p.add_argument("--files", default=DEFAULT_FILES, help="preset:TYPE, comma list")
    p.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "minisgl-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--prefill-tokens", type=int, default=2000, help="words (about tokens)")
    p.add_argument("--kv-tokens", type=int, default=16384, help="both servers' KV capacity")
    p.add_argument("--no-workload", action="store_true", help="no concurrency runs")
    p.add_argument("--llama-args", default="", help='more llama-server flags, e.g. "--poll 0"')
    p.add_argument("--minisgl-args", default="", help='more minisgl flags: "--target-itl-ms 0"')
    p.add_argument("--port", type=int, default=19700, help="first of two ports")
    p.add_argument("--kernels", default=None, help="batch sizes: time the linear op only")
    p.add_argument("--gguf", type=Path, default=None, help="--kernels / --int8-ab: the file")
    p.add_argument("--int8-ab", action="store_true", help="offline decode, fp32 vs int8 x")
    args = p.parse_args()
    if args.kernels:
        kernel_times(args.gguf or default_model_gguf(), [int(b) for b in args.kernels.split(",")])
        return
    if args.int8_ab:
        gguf = args.gguf or default_model_gguf()
        int8_ab(gguf, args.rounds, args.decode_tokens, args.prefill_tokens)
        return
    bin_dir = llama_binaries(args.llama_cpp) if args.llama_cpp else None
    specs = args.files.split(",")
    args.models_dir.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # Every file made (or a bad spec refused) before the first measurement, not midway.
    files = {spec: gguf_file(spec, args.models_dir, args.llama_cpp, bin_dir) for spec in specs}
    results = {}
    for spec, file in files.items():
        print(f"{spec}: {file} ({file.stat().st_size / 2**20:.0f} MiB)", flush=True)
        results[spec] = measure_file(file, args, bin_dir)
    print_table(results)


if __name__ == "__main__":
    main()
