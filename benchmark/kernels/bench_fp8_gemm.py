"""Micro-benchmark: the FP8 linear layer (minisgl/kernels/triton_fp8.py: fp8 weights with
128x128 block scales, activations quantized per token and 128 columns inside the GEMM) against
bf16 `F.linear` (cuBLAS), on Qwen3-0.6B's and Qwen3-8B's linear shapes, for decode-sized and
prefill-sized batches. Prints microseconds per call, TFLOP/s, and the fp8 speed-up; and each
shape's error against the fp32 product (fp8's rounding: a few percent of an element).

    python benchmark/kernels/bench_fp8_gemm.py                       # a GPU with FP8 (8.9+)
    python benchmark/kernels/bench_fp8_gemm.py --rows 1 256 4096 --model 8b
    TRITON_INTERPRET=1 python benchmark/kernels/bench_fp8_gemm.py --smoke   # CPU: runs, no timing
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (name, out features, in features) per layer kind, from the models' config.json
SHAPES = {
    "0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
BLOCK = 128
US_PER_S = 1e6


def quantized(w: torch.Tensor):
    """w as an FP8 checkpoint ships it: float8_e4m3fn and one scale per 128x128 block."""
    from minisgl.kernels.weights import Fp8Tensor

    rows, cols = w.shape
    tiles = w.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return Fp8Tensor.of_checkpoint(q, scale, (BLOCK, BLOCK))


def timed_us(fn, iters: int, device: torch.device) -> float:
    fn()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * US_PER_S


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    p.add_argument("--model", choices=list(SHAPES), default="0.6b")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one call each (CPU)")
    args = p.parse_args()
    from minisgl.kernels.triton_fp8 import fp8_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [("tiny", 256, 384)] if args.smoke else SHAPES[args.model]
    rows_list, iters = ([1, 17] if args.smoke else args.rows), (1 if args.smoke else args.iters)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    print(f"FP8 (Triton, block 128) vs {dtype} F.linear on {device}, us per call (mean of {iters})")
    print(f"{'layer':<9}{'rows':>6}{'dense us':>10}{'fp8 us':>10}{'dense TF/s':>11}"
          f"{'fp8 TF/s':>10}{'speed-up':>10}{'max err':>9}")  # fmt: skip
    for name, out, inp in shapes:
        w = torch.randn(out, inp, generator=g) * inp**-0.5
        w8 = quantized(w)
        w8 = type(w8)(w8.data.to(device), w8.scale.to(device), w8.group)
        w16 = w.to(device, dtype)
        for rows in rows_list:
            x = torch.randn(rows, inp, generator=g).to(device, dtype)
            dense_us = timed_us(lambda: F.linear(x, w16), iters, device)  # noqa: B023
            fp8_us = timed_us(lambda: fp8_linear(x, w8), iters, device)  # noqa: B023
            exact = x.float() @ w.to(device).T
            err = ((fp8_linear(x, w8).float() - exact).abs().max() / exact.abs().max()).item()
            tflops = [2 * rows * out * inp / us / 1e6 for us in (dense_us, fp8_us)]
            print(f"{name:<9}{rows:>6}{dense_us:>10.1f}{fp8_us:>10.1f}{tflops[0]:>11.2f}"
                  f"{tflops[1]:>10.2f}{dense_us / fp8_us:>9.2f}x{err:>9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
