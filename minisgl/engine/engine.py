"""The engine: model weights, paged KV pool, token/page tables, attention backend and sampler.

One engine per tensor-parallel rank. It knows nothing of requests or queues: the scheduler hands
it a `ForwardBatch` (which table rows, which positions) and gets a `PendingOutput` back.
Input ids are read from the device-side token table, and sampled ids are written back there, so
the next batch can be launched before this one's tokens reach the host (overlap scheduling).

On CUDA, `forward` only launches work on the engine's stream: host metadata goes over in staged
non-blocking copies, sampled ids come back in a non-blocking copy, and the only wait is in
`PendingOutput.result()`. Decode-only steps replay CUDA graphs (engine/graph.py).
"""

from __future__ import annotations

import logging

import torch

from minisgl.attention import create_backend, resolve_backend_name
from minisgl.attention.base import AttentionBatch, AttentionConfig
from minisgl.config import ServerArgs
from minisgl.core import SamplingParams
from minisgl.distributed import broadcast_from_primary, get_tp_info, ranks_per_node
from minisgl.engine.batch import ForwardBatch, ForwardOutput, PendingOutput, VocabMask
from minisgl.engine.context import ForwardContext, forward_context
from minisgl.engine.device import Device, nvtx_range
from minisgl.engine.graph import GraphRunner
from minisgl.engine.memory import plan_kv_pages
from minisgl.engine.prompt_scores import score_index, score_prompt
from minisgl.engine.sampler import SamplingBatch, sample
from minisgl.engine.tables import DeviceTables
from minisgl.kernels import cpu as cpu_kernels
from minisgl.kvcache.pool import KVPool, KVShape
from minisgl.models.config import ModelConfig, load_model_config
from minisgl.models.llama import CausalLM, local_head_counts
from minisgl.models.loader import load_weights
from minisgl.models.resolve import resolve_model_path_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CUDA graphs are captured up to this many decodes when --cuda-graph-max-bs is not given.
DEFAULT_CUDA_GRAPH_MAX_BS = 256

__all__ = ["Engine", "ForwardBatch", "ForwardOutput", "PendingOutput", "VocabMask"]


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


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        tp = get_tp_info()
        local_rank = tp.rank % ranks_per_node(tp.size, args.nnodes) if tp.size > 1 else 0
        self.device = resolve_device(args.device, local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dev = Device(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model_path = resolve_model_path_for(args)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        cfg = self.model_config
        # fails early, with the numbers, if heads don't divide by tp
        num_qo_heads, num_kv_heads = local_head_counts(cfg)
        self.kv_shape = KVShape(cfg.num_layers, num_kv_heads, cfg.head_dim)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        self.page_size = args.page_size
        self.max_prefill_tokens = args.resolved_max_prefill_tokens(self.device.type)

        self.backend_name = resolve_backend_name(args.attention_backend, self.device, self.dtype)
        self.model = self._build_model()
        # Table rows are request slots; width covers the longest sequence rounded up to a page.
        width = -(-(self.max_model_len + 1) // self.page_size) * self.page_size
        self.tables = DeviceTables(args.max_running_requests, width, self.dev)
        self.backend = create_backend(
            self.backend_name,
            AttentionConfig(
                num_qo_heads,
                num_kv_heads,
                cfg.head_dim,
                self.page_size,
                width,
                self.dtype,
                self.device,
            ),
        )
        graph_bs = self._graph_max_batch_size()
        self.graphs: GraphRunner | None = None  # set after the pool exists (warm-up runs eager)
        self.num_pages = plan_kv_pages(self, graph_bs)
        # One extra page, never handed out: padded graph entries write their K/V there.
        self.kv_pool = KVPool(
            self.kv_shape, self.num_pages + 1, self.page_size, self.dtype, self.device
        )
        self.tables.point_dummy_row(self.num_pages * self.page_size)
        if graph_bs > 0:
            self.graphs = GraphRunner(
                self.model, self.backend, self.kv_pool, self.tables, self.dev, graph_bs
            )
        # The pool's zero fill, the tables and the graph buffers were queued on the default
        # stream, which the engine's stream does not follow by itself.
        self.dev.follow_default_stream()
        if self.graphs is not None:
            if self.dev.is_cuda:
                self.graphs.capture()
            elif self.model.cpu_decode_stack is not None:
                logger.info("CPU decode steps run padded and op by op (--cuda-graph-max-bs)")
        logger.info(
            "engine ready: %s on %s (%s), attention %s, %d KV pages x %d tokens, "
            "CUDA graphs up to batch %d",
            cfg.architecture,
            self.device,
            self.dtype,
            self.backend_name,
            self.num_pages,
            self.page_size,
            graph_bs if self.dev.is_cuda else 0,
        )

    @property
    def page_table(self) -> torch.Tensor:
        return self.tables.page_table

    @property
    def token_table(self) -> torch.Tensor:
        return self.tables.token_table

    def _build_model(self) -> CausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(self.model_config, self.max_model_len + 1)
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, self.model_path)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            kernels = cpu_kernels.get()  # None: not buildable here, or MINISGL_CPU_KERNELS=0
            if kernels is not None:
                # The fused decode step does its own attention: only in place of torch-native's.
                model.use_cpu_kernels(kernels, fused_decode=self.backend_name == "torch")
                logger.info(
                    "CPU kernels on (%d threads); decode steps %s",
                    torch.get_num_threads(),
                    "in one fused call" if model.cpu_decode_stack is not None else "op by op",
                )
        return model.eval()

    def _graph_max_batch_size(self) -> int:
        """0 disables. On CUDA graphs need a backend that supports them; on CPU an explicit
        --cuda-graph-max-bs runs the padded decode path eagerly (what CI checks)."""
        requested = self.args.cuda_graph_max_bs
        if requested is None:
            if not self.dev.is_cuda:
                return 0
            requested = DEFAULT_CUDA_GRAPH_MAX_BS
        requested = min(requested, self.args.max_running_requests)
        if requested > 0 and self.dev.is_cuda and not self.backend.supports_graphs:
            logger.warning("CUDA graphs off: the %s backend cannot be captured", self.backend_name)
            return 0
        return requested

    # ---- the forward pass ------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, vocab_mask: VocabMask | None = None) -> PendingOutput:
        """Launch the model and the sampling of one batch."""
        return self.sample(batch, self.forward_logits(batch), vocab_mask)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Launch the model only: logits [sampled rows, vocab], for `sample` to consume. The
        scheduler splits the two when a structured-output mask needs the previous step's tokens
        (docs/architecture.md, "Structured outputs")."""
        with self.dev.on_stream(), nvtx_range("forward", self.dev.is_cuda):
            self.tables.flush()
            if self.graphs is not None and self.graphs.can_run(batch):
                return self.graphs.run(batch)
            return self._forward_eager(batch)

    @torch.inference_mode()
    def sample(
        self, batch: ForwardBatch, logits: torch.Tensor, vocab_mask: VocabMask | None = None
    ) -> PendingOutput:
        """Sample (outside any CUDA graph, so a mask never changes what graphs capture), write
        the tokens into the token table and start their copy to the host."""
        with self.dev.on_stream(), nvtx_range("sample", self.dev.is_cuda):
            return self._sample(batch, logits, vocab_mask)

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.is_decode and self.model.cpu_decode_stack is not None:
            return self._forward_decode_cpu(batch)
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        rows = torch.tensor(batch.table_rows, dtype=torch.int64)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        kv_lens = prefix + extend
        # Flatten (row, position) pairs for every token: [tokens]
        token_rows = rows.repeat_interleave(extend)
        starts = torch.cumsum(extend, 0) - extend
        positions = torch.arange(int(extend.sum())) - starts.repeat_interleave(extend)
        positions += prefix.repeat_interleave(extend)
        sample_seq = [i for i, p in enumerate(batch.sampling) if p is not None]
        last_token_index = (starts + extend - 1)[sample_seq]
        scored = score_index(batch, starts)  # prompt logprobs: their rows follow the sampled
        if scored is not None:
            last_token_index = torch.cat([last_token_index, scored])
        rows_d, prefix_d, kv_d, token_rows_d, positions_d, last_d = self.dev.stage(
            rows, prefix, kv_lens, token_rows, positions, last_token_index
        )
        input_ids = self.token_table[token_rows_d, positions_d].long()
        out_slots = self.page_table[token_rows_d, positions_d].long()
        attn = AttentionBatch(
            table_rows=rows_d,
            prefix_lens=prefix_d,
            kv_lens=kv_d,
            out_slots=out_slots,
            page_table=self.page_table,
            prefix_lens_cpu=batch.prefix_lens,
            kv_lens_cpu=kv_lens.tolist(),
            page_size=self.page_size,
        )
        ctx = ForwardContext(self.backend, self.kv_pool, self.backend.prepare(attn))
        with forward_context(ctx):
            return self.model(input_ids, positions_d, last_d)

    def _forward_decode_cpu(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode-only batch on CPU: one fused kernel call for the whole decoder stack (see
        models/cpu_decoder.py), with none of the per-step attention metadata."""
        rows = torch.tensor(batch.table_rows, dtype=torch.int64)
        positions = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        input_ids = self.token_table[rows, positions].long()
        out_slots = self.page_table[rows, positions].long()
        return self.model.forward_decode_cpu(
            input_ids, positions, out_slots, self.page_table, rows, positions + 1, self.kv_pool
        )

    def _sample(
        self, batch: ForwardBatch, logits: torch.Tensor, vocab_mask: VocabMask | None
    ) -> PendingOutput:
        seqs = [i for i, p in enumerate(batch.sampling) if p is not None]
        scores = None
        if any(batch.num_prompt_scores):  # logits: the sampled rows, then the scored ones
            scores = score_prompt(batch, logits[len(seqs) :], self.token_table, self.dev)
            logits = logits[: len(seqs)]
        if not seqs:
            if scores is None:
                return PendingOutput.empty()
            return PendingOutput([], None, None, None, None, self.dev.record_event(), scores)
        params = [p for p in (batch.sampling[i] for i in seqs) if p is not None]
        kv_lens = batch.kv_lens
        next_pos = [kv_lens[i] for i in seqs]
        rows = [batch.table_rows[i] for i in seqs]
        sb = SamplingBatch.build(
            params,
            [batch.seeds[i] for i in seqs],
            next_pos,
            self.model_config.vocab_size,
            self.dev,
            output_lens=[next_pos[j] - batch.prompt_lens[i] for j, i in enumerate(seqs)],
            eos_token_ids=tuple(self.model_config.eos_token_ids),
        )
        if vocab_mask is not None:
            words = vocab_mask.bitmask.shape[1]
            (sb.mask_rows,) = self.dev.stage(torch.tensor(vocab_mask.rows, dtype=torch.int64))
            # One staged copy of the flattened bits (stage takes 1-D tensors): [k * words]
            (flat_bits,) = self.dev.stage(vocab_mask.bitmask.reshape(-1))
            sb.mask_bits = flat_bits.view(len(vocab_mask.rows), words)
        if any(p.has_penalties for p in params):
            self._add_penalties(sb, params, rows, [batch.prompt_lens[i] for i in seqs], next_pos)
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
        rows_d, next_pos_d = self.dev.stage(torch.tensor(rows), torch.tensor(next_pos))
        self.token_table[rows_d, next_pos_d] = result.token_ids.to(torch.int32)
        host = self.dev.to_host_async
        return PendingOutput(
            params=params,
            token_ids=host(result.token_ids),
            logprobs=None if result.logprobs is None else host(result.logprobs),
            top_ids=None if result.top_ids is None else host(result.top_ids),
            top_logprobs=None if result.top_logprobs is None else host(result.top_logprobs),
            ready=self.dev.record_event(),
            prompt_scores=scores,
        )

    def _add_penalties(
        self,
        sb: SamplingBatch,
        params: list[SamplingParams],
        rows: list[int],
        prompt_lens: list[int],
        seq_lens: list[int],
    ) -> None:
        vocab = self.model_config.vocab_size
        max_len = max(seq_lens)
        rows_d, prompt_lens_d, seq_lens_d = self.dev.stage(
            torch.tensor(rows), torch.tensor(prompt_lens), torch.tensor(seq_lens)
        )
        ids = self.token_table[rows_d, :max_len].long()  # [rows, max_len]
        pos = torch.arange(max_len, device=self.device)[None, :]
        in_seq = pos < seq_lens_d[:, None]
        sb.history_ids = ids.masked_fill(~in_seq, vocab)
        sb.history_in_output = in_seq & (pos >= prompt_lens_d[:, None])
        sb.repetition, sb.presence, sb.frequency = self.dev.stage(
            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        )
