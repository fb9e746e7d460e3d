"""Embedding throughput: minisgl against llama.cpp's `llama-server --embedding` on one GGUF file.

    python benchmark/online/bench_embeddings.py --llama-cpp ~/llama.cpp [--gguf FILE] [--rounds 3]

Both servers run at once on the same file (the bundled SmolLM2-135M Q4_1 by default): minisgl
with its defaults (`--model FILE`: mean pooling, L2-normalised), llama.cpp with `--embedding
--pooling mean -t T -tb T -np BATCH` (a slot per input; its /v1/embeddings normalises too).
Each round sends each server, alternating, --requests requests of --batch inputs of --tokens
random token ids (the same ids for both, new ones every round: no prefix is reused) one
request at a time, and prints inputs per second. Before timing, both servers embed the same
inputs: the smallest cosine similarity between their vectors says they compute the same thing
(llama.cpp as the oracle). The table gives the median over rounds.
"""

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "offline"))

from bench_gguf import llama_binaries, start, stop, wait_ready  # noqa: E402

from minisgl.models.default_model import default_model_gguf  # noqa: E402

REQUEST_TIMEOUT_S = 600.0
# past the special and byte tokens, inside the vocabulary, of every tokenizer we serve
FIRST_TOKEN_ID, LAST_TOKEN_ID = 1000, 30000


def servers(args: argparse.Namespace, bin_dir: Path) -> dict[str, list[str]]:
    threads = str(args.threads)
    minisgl = [sys.executable, "-m", "minisgl.server", "--model", str(args.gguf)]
    llama = [str(bin_dir / "llama-server"), "-m", str(args.gguf), "--embedding"]
    llama += ["--pooling", "mean", "-t", threads, "-tb", threads, "-np", str(args.batch)]
    # a slot (its own KV stream: a unified cache would attend over every slot's cells) per input
    llama += ["-c", str(args.batch * (args.tokens + 16)), *shlex.split(args.llama_args)]
    return {
        "minisgl": [*minisgl, "--port", str(args.port)],
        "llama.cpp": [*llama, "--port", str(args.port + 1)],
    }


def embed(url: str, model: str, inputs: list[list[int]]) -> torch.Tensor:
    body = {"model": model, "input": inputs, "encoding_format": "float"}
    reply = httpx.post(url + "/v1/embeddings", json=body, timeout=REQUEST_TIMEOUT_S)
    reply.raise_for_status()
    data = sorted(reply.json()["data"], key=lambda item: item["index"])
    return torch.tensor([item["embedding"] for item in data])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    p.add_argument("--gguf", type=Path, default=None, help="default: the bundled model's file")
    p.add_argument("--batch", type=int, default=32, help="inputs per request")
    p.add_argument("--tokens", type=int, default=128, help="tokens per input")
    p.add_argument("--requests", type=int, default=4, help="requests per round and server")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=19720, help="first of two ports")
    p.add_argument("--llama-args", default="", help='more llama-server flags, e.g. "-ub 2048"')
    args = p.parse_args()
    args.gguf = args.gguf or default_model_gguf()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    bin_dir = llama_binaries(args.llama_cpp)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_embeddings-"))
    cmds = servers(args, bin_dir)
    procs = {name: start(name, cmd, log_dir) for name, cmd in cmds.items()}
    urls = {n: f"http://127.0.0.1:{c[c.index('--port') + 1]}" for n, c in cmds.items()}
    rng = random.Random(0)

    def batch() -> list[list[int]]:
        ids = range(FIRST_TOKEN_ID, LAST_TOKEN_ID)
        return [rng.choices(ids, k=args.tokens) for _ in range(args.batch)]

    rates: dict[str, list[float]] = {name: [] for name in cmds}
    try:
        for name, url in urls.items():
            wait_ready(url, procs[name])
        models = {n: httpx.get(u + "/v1/models").json()["data"][0]["id"] for n, u in urls.items()}
        inputs = batch()  # also the warm-up
        ours, theirs = (embed(urls[n], models[n], inputs) for n in cmds)
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=1)
        print(f"cosine(minisgl, llama.cpp) over {len(inputs)} inputs: min {cosine.min():.6f}")
        for r in range(args.rounds):
            requests = [batch() for _ in range(args.requests)]
            for name, url in urls.items():
                start_s = time.perf_counter()
                for inputs in requests:
                    embed(url, models[name], inputs)
                elapsed_s = time.perf_counter() - start_s
                rates[name].append(args.requests * args.batch / elapsed_s)
                print(f"  round {r}: {name}: {rates[name][-1]:.2f} inputs/s", flush=True)
    finally:
        stop(procs.values())
    print(f"(load average {os.getloadavg()[0]:.2f}; logs in {log_dir})")
    ours_rate, theirs_rate = (statistics.median(rates[n]) for n in ("minisgl", "llama.cpp"))
    print(
        "\n| file | inputs x tokens per request | llama.cpp inputs/s | minisgl inputs/s | ratio |"
    )
    print("|---|---|---:|---:|---:|")
    shape = f"{args.batch} x {args.tokens}"
    ratio = ours_rate / theirs_rate
    print(f"| {args.gguf.name} | {shape} | {theirs_rate:.2f} | {ours_rate:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
