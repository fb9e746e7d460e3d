"""How many KV pages fit: a share of free memory on CPU, what is left of the GPU after the rest.

On CUDA one warm-up forward at the largest prefill chunk measures the activation peak (and
compiles the attention kernels); the pool gets `mem_fraction_static` of the device less what is
held already, that peak, and reserves for CUDA graphs and the sampler, every figure logged.
It all runs before the pool exists: the engine builds it from the number planned here."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from minisgl.config import CPU_KV_MEMORY_FRACTION, MIN_KV_PAGES, ServerArgs
from minisgl.core import SamplingParams
from minisgl.distributed import get_tp_info, ranks_per_node
from minisgl.engine.batch import ForwardBatch
from minisgl.engine.graph import graph_batch_sizes
from minisgl.engine.tables import DeviceTables
from minisgl.kvcache.pool import KVPool, KVShape
from minisgl.runtime.supervisor import ChildStartupError

logger = logging.getLogger(__name__)

GIB = 1 << 30
# The sampler holds a handful of fp32/int64 [rows, vocab] temporaries at once (softmax, sort
# for top-p, hashed uniforms): reserve this many fp32-sized copies per sampled row.
SAMPLER_VOCAB_COPIES = 12
# Each captured graph keeps its own fp32 logits output alive (as many rows as its batch size);
# capturing the largest needs its [rows, vocab] temporaries once more.
GRAPH_RESERVE_BASE_BYTES = 256 << 20

# A forward of one batch through a given pool, to its sampled tokens (the engine's).
ForwardThrough = Callable[[ForwardBatch, KVPool], object]


@dataclass(frozen=True)
class MemoryNeeds:
    """What the KV budget depends on besides the flags, from the engine being built."""

    kv_shape: KVShape
    kv_dtype: torch.dtype  # what the pool stores
    vocab_size: int
    graph_max_bs: int  # 0: no CUDA graphs
    prefill_tokens: int  # the largest prefill chunk: what the warm-up forward computes
    max_model_len: int  # tokens


def plan_kv_pages(
    args: ServerArgs, needs: MemoryNeeds, tables: DeviceTables, forward: ForwardThrough
) -> int:
    """The pool size in pages. `forward` runs the warm-up on CUDA (through a temporary pool
    mapped by the dummy table row)."""
    page_bytes = needs.kv_shape.bytes_per_token(needs.kv_dtype) * args.page_size
    if args.num_pages is not None:
        num_pages = args.num_pages
    elif args.kv_cache_gb is not None:
        num_pages = int(args.kv_cache_gb * GIB // page_bytes)
    elif tables.stream.is_cuda:
        num_pages = int(_cuda_kv_budget(args, needs, tables, forward) // page_bytes)
    else:
        num_pages = _cpu_kv_pages(args, needs, page_bytes)
    if get_tp_info().size > 1:  # every rank must agree: take the smallest
        t = torch.tensor([num_pages], device=tables.stream.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        num_pages = int(t.item())
    if num_pages < MIN_KV_PAGES:  # a request's first page, and room for one more token
        raise ChildStartupError(
            f"the KV cache budget holds {num_pages} pages of {args.page_size} tokens "
            f"({page_bytes} bytes each); serving any request takes {MIN_KV_PAGES}: raise "
            "--kv-cache-gb or --mem-fraction-static (CUDA), lower --max-prefill-tokens / "
            "--max-running-requests, or set --num-pages"
        )
    return num_pages


def _cpu_kv_pages(args: ServerArgs, needs: MemoryNeeds, page_bytes: int) -> int:
    """A share of the memory available now, no more than every request slot at full length."""
    available = psutil.virtual_memory().available
    budget = CPU_KV_MEMORY_FRACTION * available / ranks_per_node(get_tp_info().size, args.nnodes)
    most = -(-args.max_running_requests * needs.max_model_len // args.page_size)
    num_pages = min(int(budget // page_bytes), most)
    logger.info(
        "KV cache: %.2f GiB of the %.2f GiB available (--kv-cache-gb or --num-pages to change)",
        num_pages * page_bytes / GIB,
        available / GIB,
    )
    return num_pages


def _cuda_kv_budget(
    args: ServerArgs, needs: MemoryNeeds, tables: DeviceTables, forward: ForwardThrough
) -> float:
    device = tables.stream.device
    torch.cuda.synchronize(device)
    free_after_weights, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_allocated(device)  # the weights, and the tables
    vocab_bytes = needs.vocab_size * 4
    graph_max_bs = needs.graph_max_bs
    graph_rows = sum(graph_batch_sizes(graph_max_bs)) + graph_max_bs
    reserves = {
        "left to others (1 - mem_fraction_static)": total * (1 - args.mem_fraction_static),
        f"prefill activations (warm-up at {needs.prefill_tokens} tokens)": _profile_prefill(
            args.page_size, needs, tables, forward
        ),
        "sampler reserve": args.max_running_requests * vocab_bytes * SAMPLER_VOCAB_COPIES,
        "graph reserve": graph_rows * vocab_bytes + GRAPH_RESERVE_BASE_BYTES if graph_max_bs else 0,
    }
    budget = free_after_weights - sum(reserves.values())
    logger.info(
        "GPU memory: total %.2f GiB, weights and tables %.2f GiB, free after them %.2f GiB, "
        "%s -> KV cache %.2f GiB",
        total / GIB,
        ours / GIB,
        free_after_weights / GIB,
        ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in reserves.items()),
        budget / GIB,
    )
    return max(budget, 0.0)


def _profile_prefill(
    page_size: int, needs: MemoryNeeds, tables: DeviceTables, forward: ForwardThrough
) -> int:
    """Peak bytes allocated by one forward of the largest prefill chunk, through a temporary
    pool just large enough for it (the dummy table row maps its positions)."""
    device = tables.stream.device
    num_tokens = needs.prefill_tokens
    pool = KVPool(needs.kv_shape, -(-num_tokens // page_size), page_size, needs.kv_dtype, device)
    row = tables.dummy_row
    tables.page_table[row, :num_tokens] = torch.arange(num_tokens, dtype=torch.int32, device=device)
    tables.token_table[row].zero_()
    greedy = SamplingParams(temperature=0.0)
    batch = ForwardBatch([row], [0], [num_tokens], [greedy], [0], [num_tokens])
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        forward(batch, pool)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    finally:
        del pool
        torch.cuda.empty_cache()
