"""The engine: model weights, paged KV pool, token/page tables, attention backend and sampler.

One engine per tensor-parallel rank. It knows nothing of requests or queues: the scheduler hands
it a `ForwardBatch` (which table rows, which positions) and gets sampled token ids back.
Input ids are read from the device-side token table, and sampled ids are written back there, so
the next batch can be launched before this one's tokens reach the host (overlap scheduling).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minisgl.attention import create_backend
from minisgl.attention.base import AttentionBatch
from minisgl.config import DEFAULT_CPU_KV_CACHE_GB, ServerArgs
from minisgl.core import SamplingParams, TokenLogprob
from minisgl.distributed import broadcast_from_primary, get_tp_info, ranks_per_node
from minisgl.engine.context import ForwardContext, forward_context
from minisgl.engine.sampler import SamplingBatch, sample
from minisgl.kvcache.pool import KVPool, KVShape
from minisgl.models.config import ModelConfig, load_model_config
from minisgl.models.llama import CausalLM, local_head_counts
from minisgl.models.loader import load_weights
from minisgl.models.resolve import resolve_model_path_for

logger = logging.getLogger(__name__)

GIB = 1 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """local_rank: this tp rank's index on its node; each rank of a node owns one GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls are very slow on most CPUs; fp32 is also the exact-parity setting.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(frozen=True)
class ForwardBatch:
    """One step's work, as plain host data. Sequence i computes positions
    [prefix_lens[i], prefix_lens[i] + extend_lens[i]) of table row table_rows[i]; when
    sampling[i] is set it also samples the token at the next position."""

    table_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling: list[SamplingParams | None]
    seeds: list[int]
    prompt_lens: list[int]  # where the output starts (frequency / presence penalties)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass(frozen=True)
class ForwardOutput:
    """Sampled tokens, one per sequence with sampling set, in batch order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        tp = get_tp_info()
        local_rank = tp.rank % ranks_per_node(tp.size, args.nnodes) if tp.size > 1 else 0
        self.device = resolve_device(args.device, local_rank)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model_path = resolve_model_path_for(args)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        cfg = self.model_config
        # fails early, with the numbers, if heads don't divide by tp
        _, num_kv_heads = local_head_counts(cfg)
        self.kv_shape = KVShape(cfg.num_layers, num_kv_heads, cfg.head_dim)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        self.page_size = args.page_size

        self.model = self._build_model()
        self.num_pages = self._num_kv_pages()
        self.kv_pool = KVPool(
            self.kv_shape, self.num_pages, self.page_size, self.dtype, self.device
        )
        # Table rows are request slots; width covers the longest sequence rounded up to a page.
        width = -(-(self.max_model_len + 1) // self.page_size) * self.page_size
        rows = args.max_running_requests
        self.page_table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self.token_table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self.backend = create_backend(args.attention_backend, self.device)
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages x %d tokens",
            cfg.architecture,
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
        )

    def _build_model(self) -> CausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(self.model_config, self.max_model_len + 1)
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, self.model_path)
        return model.eval()

    def _num_kv_pages(self) -> int:
        if self.args.num_pages is not None:
            num_pages = self.args.num_pages
        else:
            if self.args.kv_cache_gb is not None:
                budget = self.args.kv_cache_gb * GIB
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - total * (1 - self.args.mem_fraction_static)
            else:
                budget = DEFAULT_CPU_KV_CACHE_GB * GIB
            per_page = self.kv_shape.bytes_per_token(self.dtype) * self.page_size
            num_pages = int(budget // per_page)
        if get_tp_info().size > 1:  # every rank must agree: take the smallest
            t = torch.tensor([num_pages], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            num_pages = int(t.item())
        if num_pages < 1:
            raise ValueError("no memory left for the KV cache: lower --mem-fraction-static use")
        return num_pages

    # ---- the forward pass ------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        device = self.device
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        rows = torch.tensor(batch.table_rows, dtype=torch.int64)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        kv_lens = prefix + extend
        # Flatten (row, position) pairs for every token: [tokens]
        token_rows = rows.repeat_interleave(extend)
        starts = torch.cumsum(extend, 0) - extend
        positions = torch.arange(int(extend.sum())) - starts.repeat_interleave(extend)
        positions += prefix.repeat_interleave(extend)
        token_rows, positions = token_rows.to(device), positions.to(device)
        input_ids = self.token_table[token_rows, positions].long()
        out_slots = self.page_table[token_rows, positions].long()

        sample_seq = [i for i, p in enumerate(batch.sampling) if p is not None]
        last_token_index = (starts + extend - 1)[sample_seq].to(device)
        attn = AttentionBatch(
            table_rows=rows.to(device),
            prefix_lens=prefix.to(device),
            kv_lens=kv_lens.to(device),
            out_slots=out_slots,
            page_table=self.page_table,
            prefix_lens_cpu=batch.prefix_lens,
            kv_lens_cpu=kv_lens.tolist(),
            page_size=self.page_size,
        )
        ctx = ForwardContext(self.backend, self.kv_pool, self.backend.prepare(attn))
        with forward_context(ctx):
            logits = self.model(input_ids, positions, last_token_index)
        if not sample_seq:
            return ForwardOutput([], [])
        return self._sample(batch, sample_seq, kv_lens, logits)

    def _sample(
        self, batch: ForwardBatch, seqs: list[int], kv_lens: torch.Tensor, logits: torch.Tensor
    ) -> ForwardOutput:
        sample_params = [p for p in (batch.sampling[i] for i in seqs) if p is not None]
        next_pos = kv_lens[seqs]
        next_pos_cpu = next_pos.tolist()
        sb = SamplingBatch.build(
            sample_params,
            [batch.seeds[i] for i in seqs],
            next_pos_cpu,
            self.model_config.vocab_size,
            self.device,
        )
        rows = torch.tensor([batch.table_rows[i] for i in seqs], device=self.device)
        if any(p.has_penalties for p in sample_params):
            self._add_penalties(
                sb, sample_params, rows, [batch.prompt_lens[i] for i in seqs], next_pos_cpu
            )
        result = sample(logits, sb)
        if get_tp_info().size > 1:
            # Ranks compute the same logits only up to float rounding (reduction order), so a
            # near-tie could pick different tokens and the ranks' KV caches would then diverge:
            # everyone takes rank 0's choice.
            result.token_ids = broadcast_from_primary(result.token_ids)
            if result.logprobs is not None:  # the same rows want logprobs on every rank
                result.logprobs = broadcast_from_primary(result.logprobs)
            if result.top_ids is not None and result.top_logprobs is not None:
                result.top_ids = broadcast_from_primary(result.top_ids)
                result.top_logprobs = broadcast_from_primary(result.top_logprobs)
        # The sampled token becomes the next input: write it where the next step will read it.
        self.token_table[rows, next_pos.to(self.device)] = result.token_ids.to(torch.int32)
        token_ids = result.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if result.logprobs is not None:
            chosen = result.logprobs.tolist()
            assert result.top_ids is not None and result.top_logprobs is not None
            top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
            for j, p in enumerate(sample_params):
                if p.logprobs is None:
                    continue
                k = p.logprobs
                top = tuple(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
                logprobs[j] = TokenLogprob(token_ids[j], chosen[j], top)
        return ForwardOutput(token_ids, logprobs)

    def _add_penalties(
        self,
        sb: SamplingBatch,
        params: list[SamplingParams],
        rows: torch.Tensor,
        prompt_lens: list[int],
        seq_lens: list[int],
    ) -> None:
        vocab = self.model_config.vocab_size
        num_rows = len(params)
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=self.device)
        for j in range(num_rows):
            ids = self.token_table[rows[j], : seq_lens[j]].long()
            seen[j, ids] = True
            out_ids = ids[prompt_lens[j] :]
            counts[j].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        sb.seen_mask, sb.output_counts = seen, counts
        sb.repetition = torch.tensor([p.repetition_penalty for p in params], device=self.device)
        sb.presence = torch.tensor([p.presence_penalty for p in params], device=self.device)
        sb.frequency = torch.tensor([p.frequency_penalty for p in params], device=self.device)
