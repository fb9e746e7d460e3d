"""A GGUF model served as blocks vs dequantized to fp32 vs llama.cpp's server, interleaved.

Starts three servers on the same GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1):
minisgl as it serves a GGUF on CPU (`--quantization auto`: blocks), minisgl with
`--quantization none` (fp32, today's path), and llama.cpp's `llama-server` (`--llama-server`,
`-t THREADS -np 16`; left out without the flag). Then, round after round, each server in turn:

- batch-1 decode: one streamed completion of --decode-tokens greedy tokens (EOS ignored); decode
  tok/s = (tokens - 1) / (time after the first token), as bench_common's TPOT;
- the 32-prompt concurrency-16 workload of RESULTS.md section 10 (bench_serving.py: random
  prompts of 160 words +-50%, 128 output tokens +-50%, temperature 0.7, EOS ignored; the
  round's own prompts, the same for every server): output tok/s;

and last the resident memory (VmRSS) of each minisgl scheduler process and of llama-server.
Every figure is printed per round and as the median over rounds (the machine's memory bandwidth
swings between hours: only figures from the same run compare).

    python benchmark/offline/bench_gguf.py --llama-server /tmp/lcp/build/bin/llama-server

`--kernels 1,16,96` instead times the linear op alone, one thread, process CPU time (steady
under other load): SmolLM2-135M's 121 matmuls (30 layers' qkv, o, gate_up, down and the
49152-row LM head) at each batch size, as random Q4_1 blocks (Q8_0 head, as the bundled file)
and as fp32 panels, best of 7.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ONLINE = HERE.parent / "online"
sys.path.insert(0, str(ONLINE))

from bench_common import RequestSpec, build_payload, send_request  # noqa: E402

from minisgl.models.default_model import default_model_gguf  # noqa: E402

PROMPT = "The history of the city of Paris began"
READY_TIMEOUT_S = 600.0
WORKLOAD = [  # RESULTS.md section 10's concurrency-16 run
    "--dataset", "random", "--num-prompts", "32", "--max-concurrency", "16",
    "--random-input-len", "160", "--random-range-ratio", "0.5", "--random-output-len", "128",
    "--ignore-eos", "--temperature", "0.7", "--num-warmup", "2", "--disable-tqdm",
]  # fmt: skip


def start(name: str, cmd: list[str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the server)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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


async def decode_rate(url: str, model: str, tokens: int) -> float:
    spec = RequestSpec(PROMPT, tokens)
    body = build_payload(spec, model, "completions", True, 0.0)
    async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as client:
        result = await send_request(client, url + "/v1/completions", body, tokens)
    if not result.ok or result.tpot_s is None:
        raise RuntimeError(f"{url}: {result.error or 'no tokens'}")
    return 1.0 / result.tpot_s


def workload_rate(url: str, seed: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as out:
        path = out.name
    cmd = [sys.executable, str(ONLINE / "bench_serving.py"), "--base-url", url, *WORKLOAD]
    cmd += ["--seed", str(seed)]  # new prompts every round: nothing in any prefix cache
    subprocess.run([*cmd, "--output-file", path], check=True, stdout=subprocess.DEVNULL)
    record = json.loads(Path(path).read_text().splitlines()[-1])
    os.unlink(path)
    if record.get("failed"):
        raise RuntimeError(f"{url}: {record['failed']} requests failed: {record.get('errors')}")
    return float(record["output_throughput"])


def kernel_times(batches: list[int]) -> None:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from minisgl.kernels import cpu
    from minisgl.kernels.weights import PackedLinear, QuantTensor

    kernels, rng = cpu.get(), np.random.default_rng(0)
    assert kernels is not None
    torch.set_num_threads(1)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    fp32, blocks = [], []
    for i, (rows, cols) in enumerate(shapes):
        weight = rng.standard_normal((rows, cols)).astype(np.float32)
        qtype = T.Q8_0 if i == len(shapes) - 1 else T.Q4_1
        quant = QuantTensor(int(qtype), torch.from_numpy(quantize(weight, qtype)), cols)
        fp32.append(kernels.pack(torch.from_numpy(weight)))
        blocks.append(PackedLinear.of_blocks({0: quant}))
    print("| batch | fp32 panels ms | Q4_1 blocks ms |\n|---:|---:|---:|")
    for batch in batches:
        xs = {cols: torch.randn(batch, cols) for cols in (576, 1536)}
        best = []
        for weights in (fp32, blocks):
            times = []
            for _ in range(7):
                start = time.process_time()
                for w in weights:
                    kernels.linear(xs[w.in_features], w)
                times.append(time.process_time() - start)
            best.append(min(times) * 1e3)
        print(f"| {batch} | {best[0]:.1f} | {best[1]:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="default: the bundled Q4_1 file")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--no-workload", action="store_true", help="batch-1 decode and memory only")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="minisgl's KV pool (both)")
    p.add_argument("--llama-args", default="", help='more llama-server flags, e.g. "--poll 0"')
    p.add_argument("--port", type=int, default=19700, help="first of three ports")
    p.add_argument("--kernels", default=None, help="batch sizes: time the linear op only")
    args = p.parse_args()
    if args.kernels:
        kernel_times([int(b) for b in args.kernels.split(",")])
        return
    gguf = args.gguf or default_model_gguf()
    log_dir = Path(tempfile.mkdtemp(prefix="bench_gguf-"))
    minisgl = [sys.executable, "-m", "minisgl.server", "--model", str(gguf)]
    if args.kv_cache_gb is not None:
        minisgl += ["--kv-cache-gb", str(args.kv_cache_gb)]
    servers = {
        "minisgl blocks": minisgl + ["--port", str(args.port)],
        "minisgl fp32": minisgl + ["--quantization", "none", "--port", str(args.port + 1)],
    }
    if args.llama_server:
        servers["llama.cpp"] = [
            args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-tb",
            str(args.threads), "-np", "16", "-c", "16384", "--port", str(args.port + 2),
            *shlex.split(args.llama_args),
        ]  # fmt: skip
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    procs = {name: start(name, cmd, log_dir) for name, cmd in servers.items()}
    urls = {
        name: f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}" for name, cmd in servers.items()
    }
    results: dict[str, dict[str, list[float]]] = {
        n: {"decode": [], "workload": []} for n in servers
    }
    try:
        for name, url in urls.items():
            wait_ready(url, procs[name])
        models = {n: httpx.get(u + "/v1/models").json()["data"][0]["id"] for n, u in urls.items()}
        for name, url in urls.items():  # warm-up: first-use costs out of the figures
            asyncio.run(decode_rate(url, models[name], 16))
        for round_index in range(args.rounds):
            for name, url in urls.items():
                rate = asyncio.run(decode_rate(url, models[name], args.decode_tokens))
                results[name]["decode"].append(rate)
                line = f"round {round_index}: {name}: batch-1 decode {rate:.1f} tok/s"
                if not args.no_workload:
                    results[name]["workload"].append(workload_rate(url, round_index))
                    line += f", concurrency 16 {results[name]['workload'][-1]:.1f} out tok/s"
                print(line, flush=True)
        rss = {name: largest_rss_mb(proc.pid) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    print(f"\nload average {os.getloadavg()[0]:.2f}; logs in {log_dir}")
    print("| server | batch-1 decode tok/s (median) | concurrency 16 out tok/s (median) | RSS MB |")
    print("|---|---:|---:|---:|")
    for name, figures in results.items():
        decode = statistics.median(figures["decode"])
        workload = statistics.median(figures["workload"]) if figures["workload"] else float("nan")
        print(f"| {name} | {decode:.1f} | {workload:.1f} | {rss[name]:.0f} |")


if __name__ == "__main__":
    main()
