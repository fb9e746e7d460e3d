"""Micro-benchmark: Triton vs torch-native attention for one layer of a Qwen3-0.6B-shaped model
(16 query heads, 8 KV heads, head_dim 128, bf16 on CUDA), straight through the backends'
`prepare` + `forward` over a paged pool with shuffled slots.

For each decode batch size it times one layer's decode (KV lengths uniform in
--min-kv-len..--max-kv-len) and reports the KV bandwidth reached; then one prefill chunk of
--extend-tokens tokens (fresh prompts and prompts after a cached prefix). Every Triton result is
checked against torch-native, and on CUDA a captured graph of the Triton decode is replayed after
the lengths change in place (what the engine's CUDA graphs do) and checked too.

    python benchmark/kernels/bench_attention.py                  # CUDA: the default sizes
    python benchmark/kernels/bench_attention.py --batch-sizes 1 64 256 --max-kv-len 4096

Without CUDA it runs Triton's interpreter on tiny sizes: a smoke test of this script, not a
measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

from minisgl.attention.base import AttentionBackend, AttentionBatch, AttentionConfig  # noqa: E402
from minisgl.attention.torch_native import TorchNativeBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl.kvcache.pool import KVPool, KVShape  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
WARMUP_ITERS = 5
US_PER_S = 1e6
GB = 1e9
TFLOP = 1e12
CHECK_ATOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean seconds per call after a warm-up."""
    for _ in range(WARMUP_ITERS):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _make_batch(
    prefix_lens: list[int], extend_lens: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[KVPool, AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's pool (random K/V, a spare slot per sequence), a batch over shuffled slots."""
    g = torch.Generator().manual_seed(0)
    kv_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    width = max(kv_lens) + 1
    num_slots = sum(kv_lens) + len(kv_lens)
    pool = KVPool(KVShape(1, NUM_KV_HEADS, HEAD_DIM), num_slots, 1, dtype, device)
    pool.buffer.normal_()
    slots = torch.randperm(num_slots, generator=g).to(torch.int32)
    page_table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    used = 0
    for row, kv in enumerate(kv_lens):
        page_table[row, : kv + 1] = slots[used : used + kv + 1]
        used += kv + 1
    page_table = page_table.to(device)
    rows = torch.arange(len(kv_lens), device=device)
    out_slots = torch.cat(
        [
            page_table[r, p:kv].long()
            for r, (p, kv) in enumerate(zip(prefix_lens, kv_lens, strict=True))
        ]
    )
    tokens = out_slots.numel()
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    batch = AttentionBatch(
        table_rows=rows,
        prefix_lens=torch.tensor(prefix_lens, device=device),
        kv_lens=torch.tensor(kv_lens, device=device),
        out_slots=out_slots,
        page_table=page_table,
        prefix_lens_cpu=prefix_lens,
        kv_lens_cpu=kv_lens,
    )
    return pool, batch, q, k, v


def _triton(pool: KVPool) -> TritonBackend:
    width = pool.num_slots  # no sequence is longer than the pool
    dtype, device = pool.buffer.dtype, pool.buffer.device
    return TritonBackend(
        AttentionConfig(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 1, width, dtype, device)
    )


def _layer(backend: AttentionBackend, pool, batch, q, k, v) -> Callable[[], torch.Tensor]:
    """One layer's attention as the engine runs it: metadata once, then forward."""
    meta = backend.prepare(batch)
    return lambda: backend.forward(q, k, v, 0, pool, meta)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.float() - want.float()).abs().max().item()
    ok = diff <= CHECK_ATOL[got.dtype]
    if not ok:
        print(f"MISMATCH {name}: max abs diff {diff:.3e}")
    return f"{diff:.1e}" + ("" if ok else " FAIL")


def bench_decode(batch_size: int, args, dtype, device) -> tuple[str, bool]:
    g = torch.Generator().manual_seed(batch_size)
    kv_lens = torch.randint(args.min_kv_len, args.max_kv_len + 1, (batch_size,), generator=g)
    pool, batch, q, k, v = _make_batch(
        [kv - 1 for kv in kv_lens.tolist()], [1] * batch_size, dtype, device
    )
    triton_fn = _layer(_triton(pool), pool, batch, q, k, v)
    torch_fn = _layer(TorchNativeBackend(), pool, batch, q, k, v)
    diff = _compare(f"decode bs={batch_size}", triton_fn(), torch_fn())
    t_triton = _timed(triton_fn, args.iters, device)
    t_torch = _timed(torch_fn, args.iters, device)
    kv_bytes = 2 * kv_lens.sum().item() * NUM_KV_HEADS * HEAD_DIM * pool.buffer.element_size()
    graph = _graph_check(pool, batch, q, k, v, args.iters) if device.type == "cuda" else "-"
    line = (
        f"decode bs={batch_size:4d} kv~{int(kv_lens.float().mean()):5d} | triton "
        f"{t_triton * US_PER_S:8.1f} us {kv_bytes / t_triton / GB:7.0f} GB/s | torch "
        f"{t_torch * US_PER_S:8.1f} us | x{t_torch / t_triton:5.2f} | diff {diff} | graph {graph}"
    )
    return line, "FAIL" not in line


def _graph_check(pool, batch, q, k, v, iters: int) -> str:
    """Capture the Triton decode, shorten every sequence by one token in place, replay, compare
    with torch-native eager; returns the replay time and the difference."""
    backend = _triton(pool)
    backend.init_graph_state(batch.num_seqs)
    meta = backend.prepare_graph(batch, capturing=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        backend.forward(q, k, v, 0, pool, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, pool, meta)
    keep = batch.kv_lens > 1
    batch.kv_lens.sub_(keep.long())
    batch.out_slots.copy_(batch.page_table[batch.table_rows, batch.kv_lens - 1].long())
    shorter = AttentionBatch(
        table_rows=batch.table_rows,
        prefix_lens=batch.kv_lens - 1,
        kv_lens=batch.kv_lens,
        out_slots=batch.out_slots,
        page_table=batch.page_table,
        prefix_lens_cpu=(batch.kv_lens - 1).tolist(),
        kv_lens_cpu=batch.kv_lens.tolist(),
    )
    backend.prepare_graph(shorter, capturing=False)
    graph.replay()
    want = _layer(TorchNativeBackend(), pool, shorter, q, k, v)()
    diff = _compare("graph replay", out, want)
    t_replay = _timed(graph.replay, iters, q.device)
    return f"{t_replay * US_PER_S:.1f} us, diff {diff}"


def bench_extend(args, dtype, device) -> tuple[str, bool]:
    g = torch.Generator().manual_seed(1)
    prefix_lens, extend_lens = [], []
    while sum(extend_lens) < args.extend_tokens:
        ext = int(torch.randint(args.min_kv_len, args.max_kv_len // 2 + 1, (1,), generator=g))
        ext = min(ext, args.extend_tokens - sum(extend_lens))
        # every other sequence continues after a cached prefix (chunked prefill, radix hit)
        prefix_lens.append(0 if len(extend_lens) % 2 == 0 else ext)
        extend_lens.append(ext)
    pool, batch, q, k, v = _make_batch(prefix_lens, extend_lens, dtype, device)
    triton_fn = _layer(_triton(pool), pool, batch, q, k, v)
    torch_fn = _layer(TorchNativeBackend(), pool, batch, q, k, v)
    diff = _compare("extend", triton_fn(), torch_fn())
    t_triton = _timed(triton_fn, args.iters, device)
    t_torch = _timed(torch_fn, args.iters, device)
    # causal QK^T and PV: 2 matmuls x 2 flop per multiply-add, over the visible keys
    visible = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens, strict=True))
    flops = 4 * visible * NUM_HEADS * HEAD_DIM
    line = (
        f"extend {sum(extend_lens)} tokens in {len(extend_lens)} seqs | triton "
        f"{t_triton * US_PER_S:8.1f} us {flops / t_triton / TFLOP:6.1f} TFLOP/s | torch "
        f"{t_torch * US_PER_S:8.1f} us | x{t_torch / t_triton:5.2f} | diff {diff}"
    )
    return line, "FAIL" not in line


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256] if cuda else [2]
    )
    parser.add_argument("--min-kv-len", type=int, default=100 if cuda else 20)
    parser.add_argument("--max-kv-len", type=int, default=2048 if cuda else 140)
    parser.add_argument("--extend-tokens", type=int, default=8192 if cuda else 96)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=50 if cuda else 1)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    print(f"{device} {torch.cuda.get_device_name() if cuda else '(Triton interpreter)'} {dtype}")
    results = [bench_decode(bs, args, dtype, device) for bs in args.batch_sizes]
    results.append(bench_extend(args, dtype, device))
    for line, _ in results:
        print(line)
    if not all(ok for _, ok in results):
        sys.exit("Triton results differ from torch-native (see MISMATCH lines)")


if __name__ == "__main__":
    main()
