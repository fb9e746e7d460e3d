"""`bench.py --decode-floor`: minisgl's CPU decode speed next to what the hardware allows,
both measured in the same run.

- Batch-1 decode (one stream, `--floor-prompt-len` tokens in, `--floor-output-len` out): every
  step reads every weight once, so the floor is the weights' bytes over the machine's read
  bandwidth, measured as a `tensor.sum()` over a buffer of the same size with the engine's
  thread count: the best of several passes, over plain memory and over memory advised for
  transparent huge pages (what minisgl keeps its weights in), whichever reads faster. The
  median pass is printed too: on a shared VM the best pass can catch a short window of much
  higher bandwidth (benchmark/RESULTS.md section 10 saw 35 vs 61 GB/s), which a decode run
  that lasts seconds cannot.
- The batched workload (bench.py's `--workload` with its flags, all requests at once): the
  floor is its FLOPs (prefill and decode matmuls, attention, the LM head for every sampled
  token) over the best matmul rate measured here (torch's `mm` and, when built, minisgl's CPU
  kernel, on the model's largest layer shape and a large square GEMM).

Ratios are floor / measured: 100% would be the hardware limit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Req, next_request_id
from minisgl.models.model_config import ModelConfig

try:  # absent before the CPU kernels existed: the floors still measure older checkouts
    from minisgl.kernels import cpu as cpu_kernels
except ImportError:
    cpu_kernels = None  # type: ignore[assignment]
try:  # minisgl/kernels/cpu_ops.py; in cpu.py before it
    from minisgl.kernels.cpu_ops import huge_page_zeros
except ImportError:
    huge_page_zeros = getattr(cpu_kernels, "huge_page_zeros", None)

BANDWIDTH_REPEATS = 10
MATMUL_REPEATS = 5
MATMUL_ROWS = 512  # a prefill-sized batch of tokens
SQUARE_GEMM = 1024
BATCH1_REPEATS = 3
GB = 1e9


@dataclass(frozen=True)
class FloorReport:
    weight_bytes: int
    read_gb_s: float  # the best pass: the floor
    read_gb_s_median: float
    batch1_tok_s: float
    matmul_gflop_s: float
    matmul_source: str
    workload_gflop: float
    workload_s: float

    @property
    def batch1_floor_tok_s(self) -> float:
        return self.read_gb_s * GB / self.weight_bytes

    @property
    def workload_floor_s(self) -> float:
        return self.workload_gflop / self.matmul_gflop_s

    def lines(self) -> list[str]:
        b1, b1_floor = self.batch1_tok_s, self.batch1_floor_tok_s
        w, w_floor = self.workload_s, self.workload_floor_s
        return [
            f"read bandwidth (sum over {self.weight_bytes / GB:.3f} GB, "
            f"{torch.get_num_threads()} threads): {self.read_gb_s:.1f} GB/s "
            f"(median pass {self.read_gb_s_median:.1f} GB/s)",
            f"batch-1 decode: {b1:.1f} tok/s | weight-bandwidth floor {b1_floor:.1f} tok/s "
            f"({self.weight_bytes / 1e6:.0f} MB per token) | {b1 / b1_floor:.0%} of the floor "
            f"({b1 / (b1_floor * self.read_gb_s_median / self.read_gb_s):.0%} at the median)",
            f"matmul rate: {self.matmul_gflop_s:.1f} GFLOP/s ({self.matmul_source})",
            f"batched workload: {w:.2f} s | FLOP floor {w_floor:.2f} s "
            f"({self.workload_gflop:.1f} GFLOP) | {w_floor / w:.0%} of the floor",
            f"load average (1 min): {os.getloadavg()[0]:.2f}",
        ]


# ---- what the model needs --------------------------------------------------------------------


def decode_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: every projection, norm and the LM head (the
    embedding lookup reads one row per token, negligible). Dense models only."""
    q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * cfg.intermediate_size
    per_layer += 2 * hidden  # the two norms
    if cfg.attention_bias:
        per_layer += q + 2 * kv
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    params = cfg.num_layers * per_layer + cfg.vocab_size * hidden + hidden
    return params * torch.empty(0, dtype=dtype).element_size()


def workload_flops(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Multiply-adds x 2 of prefilling every prompt and decoding every output token."""
    q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    matmul_per_token = (
        2
        * cfg.num_layers
        * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * cfg.intermediate_size)
    )
    head_per_sample = 2 * cfg.vocab_size * hidden
    attention_per_position = 4 * cfg.num_layers * q  # q.k and p.v for one query and one key
    total = 0.0
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        computed = prompt_len + output_len - 1  # the last sampled token is never fed back
        total += computed * matmul_per_token + output_len * head_per_sample
        # token at position p attends to p + 1 keys
        total += attention_per_position * computed * (computed + 1) / 2
    return total


# ---- machine rates ---------------------------------------------------------------------------


def _times_s(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    return min(_times_s(fn, repeats))


def read_bandwidth_gb_s(num_bytes: int) -> tuple[float, float]:
    """(best, median) GB/s of a `sum()` over `num_bytes`, from the faster buffer kind."""
    numel = num_bytes // 4
    buffers = [torch.ones(numel, dtype=torch.float32)]
    if huge_page_zeros is not None:
        buffers.append(huge_page_zeros((numel,), torch.float32).fill_(1.0))
    rates = [
        sorted(num_bytes / t / GB for t in _times_s(buf.sum, BANDWIDTH_REPEATS)) for buf in buffers
    ]
    fastest = max(rates, key=lambda r: r[-1])
    return fastest[-1], fastest[len(fastest) // 2]


def matmul_rate(cfg: ModelConfig) -> tuple[float, str]:
    """The best fp32 matmul rate measured here (GFLOP/s) and what reached it."""
    gen = torch.Generator().manual_seed(0)
    k, n = cfg.hidden_size, 2 * cfg.intermediate_size
    x = torch.randn(MATMUL_ROWS, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    w_t = w.t().contiguous()
    square = torch.randn(SQUARE_GEMM, SQUARE_GEMM, generator=gen)
    shape_flops = 2 * MATMUL_ROWS * k * n
    rates = {
        f"torch mm {MATMUL_ROWS}x{k}x{n}": shape_flops / _best_s(lambda: x @ w_t, MATMUL_REPEATS),
        f"torch mm {SQUARE_GEMM}^3": 2
        * SQUARE_GEMM**3
        / _best_s(lambda: square @ square, MATMUL_REPEATS),
    }
    kernels = cpu_kernels.get() if cpu_kernels is not None else None
    if kernels is not None:
        packed = kernels.pack(w)
        rates[f"minisgl kernel {MATMUL_ROWS}x{k}x{n}"] = shape_flops / _best_s(
            lambda: kernels.linear(x, packed), MATMUL_REPEATS
        )
    best = max(rates, key=lambda name: rates[name])
    others = ", ".join(f"{name} {rate / GB:.1f}" for name, rate in rates.items() if name != best)
    return rates[best] / GB, f"{best}; others: {others}"


# ---- minisgl runs ----------------------------------------------------------------------------


def batch1_decode_tok_s(llm: LLM, prompt_len: int, output_len: int, vocab_size: int) -> float:
    """Decode tokens per second of one stream, from its first token to its last (prefill not
    counted); the fastest of a few runs."""
    best = 0.0
    for run in range(BATCH1_REPEATS):
        llm.scheduler.flush_cache()
        prompt = [(7919 * (i + run) + 13) % vocab_size for i in range(prompt_len)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        req = Req(next_request_id(), prompt, params)
        llm.scheduler.add_request(req)
        stamps: list[float] = []
        while llm.scheduler.has_work():
            for out in llm.scheduler.step():
                stamps += [time.perf_counter()] * out.num_new_tokens
        if len(stamps) != output_len:
            raise RuntimeError(f"batch-1 run produced {len(stamps)} tokens, wanted {output_len}")
        best = max(best, (output_len - 1) / (stamps[-1] - stamps[0]))
    return best


def measure(
    llm: LLM,
    cfg: ModelConfig,
    dtype: torch.dtype,
    prompt_len: int,
    output_len: int,
    run_workload: Callable[[], float],
    prompt_lens: list[int],
    output_lens: list[int],
) -> FloorReport:
    """`run_workload` runs bench.py's workload once through `llm` and returns its seconds."""
    weight_bytes = decode_weight_bytes(cfg, dtype)
    batch1 = batch1_decode_tok_s(llm, prompt_len, output_len, cfg.vocab_size)
    workload_s = run_workload()
    # after the runs: their memory is warm and free
    read, read_median = read_bandwidth_gb_s(weight_bytes)
    rate, source = matmul_rate(cfg)
    return FloorReport(
        weight_bytes=weight_bytes,
        read_gb_s=read,
        read_gb_s_median=read_median,
        batch1_tok_s=batch1,
        matmul_gflop_s=rate,
        matmul_source=source,
        workload_gflop=workload_flops(cfg, prompt_lens, output_lens) / GB,
        workload_s=workload_s,
    )
