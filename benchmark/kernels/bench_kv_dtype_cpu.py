"""The C decode-attention kernel (minisgl/kernels/csrc/attention.c) over KV pools of each
--kv-cache-dtype: one layer of a Qwen3-0.6B-shaped model (16 query heads, 8 KV heads, head_dim
128), every decode at --context-len positions on shuffled pages, the pool dtypes alternating
pass by pass (the machine's speed drifts); best of --rounds passes, in ms per layer call
(wall time; with --threads 1 the thread's CPU time, steady under other load).

    python benchmark/kernels/bench_kv_dtype_cpu.py --batch-sizes 1,16 --context-len 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from minisgl.kernels import cpu
from minisgl.kernels.weights import huge_page_zeros
from minisgl.kvcache.pool import KV_CACHE_DTYPES

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
PAGE_SIZE = 16
MS = 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--context-len", type=int, default=2048)
    p.add_argument("--dtypes", default="auto,bf16,fp16,fp8_e4m3")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument(
        "--threads", type=int, default=None, help="1: the thread's CPU time (load-proof)"
    )
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    kernels = cpu.get()
    assert kernels is not None, "no CPU kernels here"
    names = args.dtypes.split(",")
    g = torch.Generator().manual_seed(0)
    for batch in map(int, args.batch_sizes.split(",")):
        pages = -(-args.context_len // PAGE_SIZE)
        slots = batch * pages * PAGE_SIZE
        k32, v32 = (torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        order = torch.randperm(batch * pages, generator=g).view(batch, pages)
        page_table = (order[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten(1)
        page_table = page_table.to(torch.int32).contiguous()
        rows = torch.arange(batch)
        kv_lens = torch.full((batch,), args.context_len, dtype=torch.int64)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g)
        out = torch.empty_like(q)
        caches = {}
        for n in names:  # in huge pages, as the engine's pool
            dtype = KV_CACHE_DTYPES.get(n, torch.float32)
            caches[n] = tuple(huge_page_zeros(x.shape, dtype).copy_(x) for x in (k32, v32))
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            for n in names:
                start = clock()
                kernels.decode_attention(
                    q, rows, rows, kv_lens, page_table, *caches[n], out, HEAD_DIM**-0.5
                )
                best[n] = min(best[n], clock() - start)
        kv_bytes = {n: 2 * slots * NUM_KV_HEADS * HEAD_DIM * caches[n][0].itemsize for n in names}
        print(f"batch {batch}, context {args.context_len}, {torch.get_num_threads()} threads:")
        for n in names:
            rate = kv_bytes[n] / best[n] / 1e9
            print(f"  {n:9s} {best[n] * MS:7.3f} ms per layer  ({rate:5.1f} GB/s of K/V)")


if __name__ == "__main__":
    main()
