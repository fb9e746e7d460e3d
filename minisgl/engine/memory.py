"""How many KV pages fit: a fixed budget on CPU, what is left of the GPU after everything else.

On CUDA, after the weights are loaded, one warm-up forward at the largest prefill chunk measures
the activation peak (it also compiles/JITs the attention kernels before the first request). The
pool then gets `mem_fraction_static` of the device, minus what other processes and our weights
already hold, minus that peak, minus a reserve for CUDA graphs and the sampler's [batch, vocab]
temporaries. Every number is logged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minisgl.config import DEFAULT_CPU_KV_CACHE_GB
from minisgl.core import SamplingParams
from minisgl.distributed import get_tp_info
from minisgl.engine.batch import ForwardBatch
from minisgl.engine.graph import graph_batch_sizes
from minisgl.kvcache.pool import KVPool

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

logger = logging.getLogger(__name__)

GIB = 1 << 30
# The sampler holds a handful of fp32/int64 [rows, vocab] temporaries at once (softmax, sort
# for top-p, hashed uniforms): reserve this many fp32-sized copies per sampled row.
SAMPLER_VOCAB_COPIES = 12
# Each captured graph keeps its own fp32 logits output alive (as many rows as its batch size);
# capturing the largest needs its [rows, vocab] temporaries once more.
GRAPH_RESERVE_BASE_BYTES = 256 << 20


def plan_kv_pages(engine: Engine, graph_max_bs: int) -> int:
    args = engine.args
    per_page = engine.kv_shape.bytes_per_token(engine.dtype) * engine.page_size
    if args.num_pages is not None:
        num_pages = args.num_pages
    elif args.kv_cache_gb is not None:
        num_pages = int(args.kv_cache_gb * GIB // per_page)
    elif engine.dev.is_cuda:
        num_pages = int(_cuda_kv_budget(engine, graph_max_bs) // per_page)
    else:
        num_pages = int(DEFAULT_CPU_KV_CACHE_GB * GIB // per_page)
    if get_tp_info().size > 1:  # every rank must agree: take the smallest
        t = torch.tensor([num_pages], device=engine.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        num_pages = int(t.item())
    if num_pages < 1:
        raise ValueError(
            "no memory left for the KV cache: raise --mem-fraction-static, lower "
            "--max-prefill-tokens / --max-running-requests, or set --num-pages"
        )
    return num_pages


def _cuda_kv_budget(engine: Engine, graph_max_bs: int) -> float:
    device = engine.device
    torch.cuda.synchronize(device)
    free_after_weights, total = torch.cuda.mem_get_info(device)
    activation_peak = _profile_prefill(engine)
    vocab_bytes = engine.model_config.vocab_size * 4
    sampler_reserve = engine.args.max_running_requests * vocab_bytes * SAMPLER_VOCAB_COPIES
    graph_rows = sum(graph_batch_sizes(graph_max_bs)) + graph_max_bs if graph_max_bs else 0
    graph_reserve = graph_rows * vocab_bytes + GRAPH_RESERVE_BASE_BYTES if graph_max_bs else 0
    not_ours = total * (1 - engine.args.mem_fraction_static)
    budget = free_after_weights - not_ours - activation_peak - sampler_reserve - graph_reserve
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    logger.info(
        "GPU memory: total %.2f GiB, weights %.2f GiB, free after weights %.2f GiB, "
        "left to others (1 - mem_fraction_static) %.2f GiB, prefill activations %.2f GiB "
        "(warm-up at %d tokens), sampler reserve %.2f GiB, graph reserve %.2f GiB -> "
        "KV cache %.2f GiB",
        total / GIB,
        weights / GIB,
        free_after_weights / GIB,
        not_ours / GIB,
        activation_peak / GIB,
        engine.max_prefill_tokens,
        sampler_reserve / GIB,
        graph_reserve / GIB,
        budget / GIB,
    )
    return max(budget, 0.0)


def _profile_prefill(engine: Engine) -> int:
    """Peak bytes allocated by one forward of the largest prefill chunk, through a temporary
    pool just large enough for it (the dummy table row maps its positions)."""
    device = engine.device
    num_tokens = min(engine.max_prefill_tokens, engine.max_model_len)
    num_pages = -(-num_tokens // engine.page_size)
    pool = KVPool(engine.kv_shape, num_pages, engine.page_size, engine.dtype, device)
    row = engine.tables.dummy_row
    engine.tables.page_table[row, :num_tokens] = torch.arange(
        num_tokens, dtype=torch.int32, device=device
    )
    engine.tables.token_table[row].zero_()
    batch = ForwardBatch(
        table_rows=[row],
        prefix_lens=[0],
        extend_lens=[num_tokens],
        sampling=[SamplingParams(temperature=0.0)],
        seeds=[0],
        prompt_lens=[num_tokens],
    )
    engine.kv_pool = pool
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        engine.forward(batch).result()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    finally:
        del engine.kv_pool
        del pool
        torch.cuda.empty_cache()
    return int(peak)
