"""Micro-benchmark: one batch's sampling (minisgl.engine.sampler.Sampler) over a Qwen3-sized
vocabulary (151,936), for the sampling settings clients send, on the device at hand.

Logits are random with a spread like a language model's (scale --logit-scale), so a top-p
nucleus holds tens to hundreds of tokens; --logit-scale 0.3 makes it thousands (a flat
distribution, the slow case of top-p without top-k).

    python benchmark/kernels/bench_sampling.py
    python benchmark/kernels/bench_sampling.py --rows 1 16 64 256 --device cuda
    MINISGL_FUSED_KERNELS=0 python benchmark/kernels/bench_sampling.py ...   # torch ops on CUDA
"""

from __future__ import annotations

import argparse
import time

import torch

from minisgl.core import SamplingParams
from minisgl.engine.device import ComputeStream
from minisgl.engine.sampler import Sampler
from minisgl.engine.sampling_batch import SamplingBatch

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "Qwen3 (t 0.6, top-k 20, top-p 0.95)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    # 1,000 tokens of history per row (half prompt, half output), as the engine passes them
    "penalties (rep 1.1, freq 0.5, pres 0.5)": dict(
        temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
    ),
}
HISTORY_LEN = 1000
VOCAB = 151936
MS_PER_S = 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--logit-scale", type=float, default=4.0)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    device = ComputeStream(torch.device(args.device))
    sample = Sampler(device.device).sample
    g = torch.Generator().manual_seed(0)
    print(f"sampling over {VOCAB} tokens on {args.device}, ms per batch (mean of {args.iters})")
    print(f"{'setting':<38}" + "".join(f"{f'{r} rows':>12}" for r in args.rows))
    for name, kwargs in SETTINGS.items():
        cells = []
        for rows in args.rows:
            logits = (torch.randn(rows, VOCAB, generator=g) * args.logit_scale).to(device.device)
            params = [SamplingParams(**kwargs)] * rows  # type: ignore[arg-type]
            sb = SamplingBatch.build(params, list(range(rows)), [7] * rows, VOCAB, device)
            if params[0].has_penalties:
                _add_history(sb, rows, g, device)
            with device.active():  # the engine's stream: what synchronize waits for
                sample(logits, sb)  # warm-up
                device.synchronize()
                start = time.perf_counter()
                for _ in range(args.iters):
                    sample(logits, sb)
                device.synchronize()
            cells.append((time.perf_counter() - start) / args.iters * MS_PER_S)
        print(f"{name:<38}" + "".join(f"{ms:12.2f}" for ms in cells))


def _add_history(sb: SamplingBatch, rows: int, g: torch.Generator, device: ComputeStream) -> None:
    """What SamplingBatch.for_batch adds for penalties, for random token histories (the
    penalties themselves come with the batch, from its params)."""
    ids = torch.randint(0, VOCAB, (rows, HISTORY_LEN), generator=g)
    in_output = (torch.arange(HISTORY_LEN) >= HISTORY_LEN // 2)[None, :].expand(rows, -1)
    sb.history = (ids.to(device.device), in_output.to(device.device))


if __name__ == "__main__":
    main()
