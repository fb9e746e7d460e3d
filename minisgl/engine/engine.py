"""The engine: model weights, paged KV pool, token/page tables, attention backend and sampler.

One engine per tensor-parallel rank, knowing nothing of requests: the scheduler hands it a
`ForwardBatch` (table rows, positions) and gets a `PendingOutput` back. Input ids come from the
device-side token table and sampled ids go back there, so the next batch can launch before this
one's tokens reach the host; on CUDA `forward` only queues work on the engine's stream, and the
only wait is in `PendingOutput.result()`. Decode-only steps replay CUDA graphs (graph.py)."""

import logging
import operator

import torch
from torch import Tensor

from minisgl.attention import create_backend, resolve_backend_name
from minisgl.attention.base import AttentionBatch, AttentionConfig, host_tensor
from minisgl.attention.context import ForwardContext, forward_context
from minisgl.config import ServerArgs
from minisgl.distributed import broadcast_from_primary, get_tp_info, ranks_per_node
from minisgl.engine.batch import ForwardBatch, PendingOutput, PromptScores, VocabMask
from minisgl.engine.device import ComputeStream, nvtx_range
from minisgl.engine.graph import GraphRunner
from minisgl.engine.memory import MemoryNeeds, plan_kv_pages
from minisgl.engine.sampler import Sampler
from minisgl.engine.sampling_batch import SamplingBatch
from minisgl.engine.tables import DeviceTables
from minisgl.kernels import cpu, gpu
from minisgl.kvcache.pool import KV_CACHE_DTYPES, KVPool, KVShape
from minisgl.layers.linear import PackedWeight
from minisgl.layers.moe import Experts
from minisgl.models.llama import CausalLM, local_head_counts
from minisgl.models.loader import gguf_blocks, load_weights
from minisgl.models.model_config import load_model_config
from minisgl.models.resolve import resolve_model_path_for
from minisgl.runtime.stages import stage

logger = logging.getLogger(__name__)

# CUDA graphs are captured up to this many decodes when --cuda-graph-max-bs is not given.
DEFAULT_CUDA_GRAPH_MAX_BS = 256
_PLAIN_GREEDY = operator.attrgetter("is_plain_greedy")  # all(map(...)): 2x a generator's pace


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """local_rank: this tp rank's index on its node; each rank of a node owns one GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls are very slow on most CPUs; fp32 is also the exact-parity setting.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)  # ServerArgs allows float32, float16 and bfloat16


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        tp = get_tp_info()
        local_rank = tp.rank % ranks_per_node(tp.size, args.nnodes) if tp.size > 1 else 0
        self.device = resolve_device(args.device, local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.stream = ComputeStream(self.device)  # where the forward is queued, and the copies
        self.dtype = resolve_dtype(args.dtype, self.device)
        kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, self.dtype)
        if self.device.type == "cuda" and kv_dtype.itemsize == 2 and kv_dtype != self.dtype:
            # (FlashInfer's and our Triton kernels read K/V in the queries' dtype or fp8)
            raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} on CUDA needs that --dtype")
        self.model_path = resolve_model_path_for(args)
        self.model_config = cfg = load_model_config(self.model_path)
        # fails early, with the numbers, if heads don't divide by tp
        num_qo_heads, num_kv_heads = local_head_counts(cfg)
        kv_shape = KVShape(cfg.num_layers, num_kv_heads, cfg.head_dim)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        self.max_prefill_tokens = args.resolved_max_prefill_tokens(self.device.type)
        self.backend_name = resolve_backend_name(args.attention_backend, self.device, self.dtype)
        self.model = self._build_model()
        # Table rows are request slots; width covers the longest sequence rounded up to a page.
        page_size = args.page_size
        width = -(-(self.max_model_len + 1) // page_size) * page_size
        self.tables = DeviceTables(args.max_running_requests, width, self.stream)
        heads = (num_qo_heads, num_kv_heads, cfg.head_dim)
        attention = AttentionConfig(*heads, page_size, width, self.dtype, self.device, kv_dtype)
        self.backend = create_backend(self.backend_name, attention)
        self.sampler = Sampler(self.device)
        graph_bs = self._graph_max_batch_size()
        prefill_tokens = min(self.max_prefill_tokens, self.max_model_len)
        needs = MemoryNeeds(
            kv_shape, kv_dtype, cfg.vocab_size, graph_bs, prefill_tokens, self.max_model_len
        )
        with stage("planning the KV cache (CUDA: a warm-up forward, JIT builds: up to ~30 s)"):
            self.num_pages = plan_kv_pages(args, needs, self.tables, self._forward_through)
        # One extra page, never handed out: padded graph entries write their K/V there.
        with stage(f"allocating {self.num_pages} KV pages"):
            self.kv_pool = KVPool(
                kv_shape, self.num_pages + 1, page_size, kv_dtype, self.device, self.model.kv_scales
            )
        self.tables.point_dummy_row(self.num_pages * page_size)
        self.graphs = (
            GraphRunner(self.model, self.backend, self.kv_pool, self.tables, graph_bs)
            if graph_bs
            else None
        )
        # The pool's zero fill, the tables and the graph buffers were queued on the default
        # stream, which the engine's stream does not follow by itself.
        self.stream.follow_default_stream()
        if self.graphs is not None and self.stream.is_cuda:
            with stage("capturing CUDA graphs (~1-2 s on an H200)"):
                self.graphs.capture()
        elif self.graphs is not None and self.model.cpu_decode_stack is not None:
            logger.info("CPU decode steps run padded and op by op (--cuda-graph-max-bs)")
        logger.info(
            "engine ready: %s on %s (%s), attention %s, %d KV pages x %d tokens (%s KV), "
            "CUDA graphs up to batch %d",
            cfg.architecture,
            self.device,
            self.dtype,
            self.backend_name,
            self.num_pages,
            page_size,
            kv_dtype,
            graph_bs if self.stream.is_cuda else 0,
        )

    def _build_model(self) -> CausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(self.model_config, self.max_model_len + 1)
        finally:
            torch.set_default_dtype(previous)
        # None: not fp32 on the CPU, not buildable here, or MINISGL_CPU_KERNELS=0
        kernels = cpu.kernels_for(self.device, self.dtype)
        blocks = gguf_blocks(self.args, self.model_path, kernels, f"{self.dtype} on {self.device}")
        # None: FP8 checkpoints dequantize at load
        fp8 = gpu.fp8_linear_kernels(self.device) if self.args.quantization != "none" else None
        with stage(f"loading the weights of {self.model_path.name} (~1-6 s per GB)"):
            load_weights(model, self.model_path, blocks, keep_fp8=fp8 is not None)
        if fp8 is not None and blocks is None:  # (with GGUF blocks, `quant` holds those)
            fp8_layers = [m for m in model.modules() if isinstance(m, PackedWeight) and m.quant]
            for m in fp8_layers:
                m.use_fp8(fp8.fp8_linear)
            moe = sum(m.use_fp8() for m in model.modules() if isinstance(m, Experts))
            if fp8_layers or moe:  # the C kernels multiply by fp32 panels and GGUF blocks only
                kernels = None
                logger.info("FP8 GEMMs in %d linear and %d MoE layers", len(fp8_layers), moe)
        if kernels is not None:
            # The fused decode step does its own attention: only in place of torch-native's.
            model.use_cpu_kernels(kernels, fused_decode=self.backend_name == "torch")
            logger.info(
                "CPU kernels on (%d threads, %s weights); decode steps %s",
                torch.get_num_threads(),
                "GGUF block" if blocks else "fp32 panel",
                "in one fused call" if model.cpu_decode_stack is not None else "op by op",
            )
        return model.eval()

    def _graph_max_batch_size(self) -> int:
        """0 disables. On CUDA graphs need a backend that supports them; on CPU an explicit
        --cuda-graph-max-bs runs the padded decode path eagerly (what CI checks)."""
        requested = self.args.cuda_graph_max_bs
        if requested is None:
            requested = DEFAULT_CUDA_GRAPH_MAX_BS if self.stream.is_cuda else 0
        requested = min(requested, self.args.max_running_requests)
        if requested > 0 and self.stream.is_cuda and not self.backend.supports_graphs:
            logger.warning("CUDA graphs off: the %s backend cannot be captured", self.backend_name)
            return 0
        return requested

    # ---- the forward pass ------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, vocab_mask: VocabMask | None = None) -> PendingOutput:
        """Launch the model and the sampling of one batch (each under inference mode)."""
        return self.sample(batch, self.forward_logits(batch), vocab_mask)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> Tensor:
        """Launch the model only: logits [sampled rows, vocab], for `sample` to consume. The
        scheduler splits the two when a structured-output mask needs the previous step's tokens
        (docs/architecture.md, "Structured outputs")."""
        with self.stream.active(), nvtx_range("forward", self.stream.is_cuda):
            self.tables.flush()
            if self.graphs is not None and self.graphs.can_run(batch):
                return self.graphs.run(batch)
            if batch.is_decode and (stack := self.model.cpu_decode_stack) is not None:
                # One fused kernel call for the whole decoder stack (models/cpu_decoder.py),
                # with none of the per-step attention metadata.
                rows, positions = batch.rows_and_positions
                return stack.forward(
                    self.tables.token_table, self.tables.page_table, rows, positions, self.kv_pool
                )
            return self._forward_eager(batch, self.kv_pool)

    @torch.inference_mode()
    def sample(
        self, batch: ForwardBatch, logits: Tensor, vocab_mask: VocabMask | None = None
    ) -> PendingOutput:
        """Sample (outside any CUDA graph, so a mask never changes what graphs capture), write
        the tokens into the token table and start their copy to the host."""
        with self.stream.active(), nvtx_range("sample", self.stream.is_cuda):
            return self._sample(batch, logits, vocab_mask)

    @torch.inference_mode()
    def _forward_through(self, batch: ForwardBatch, pool: KVPool) -> object:
        """One batch through `pool`, to its sampled tokens (the memory plan's warm-up)."""
        with self.stream.active():
            return self._sample(batch, self._forward_eager(batch, pool), None).result()

    def _forward_eager(self, batch: ForwardBatch, pool: KVPool) -> Tensor:
        extend = host_tensor(batch.extend_lens, torch.int64)
        prefix = host_tensor(batch.prefix_lens, torch.int64)
        kv_lens = prefix + extend
        # Flatten (row, position) pairs for every token: [tokens]
        token_rows = host_tensor(batch.table_rows, torch.int64).repeat_interleave(extend)
        starts = torch.cumsum(extend, 0) - extend
        offsets = starts - prefix  # sequence i's position p is the batch's token offsets[i] + p
        positions = torch.arange(int(extend.sum())) - offsets.repeat_interleave(extend)
        # Logits at each sampled sequence's last token, then at the positions that score prompt
        # tokens (ForwardBatch.num_prompt_scores); then the final states that embeddings pool.
        scored = [starts[i] + torch.arange(c) for i, c in enumerate(batch.num_prompt_scores) if c]
        pooled = batch.pooled_positions
        pooled_index = [offsets[i] + torch.arange(p.start, p.stop) for i, p in pooled.items()]
        index = torch.cat([(starts + extend - 1)[batch.sampled], *scored, *pooled_index])
        rows_d, prefix_d, kv_d, token_rows_d, positions_d, index_d = self.stream.stage(
            torch.int64, batch.table_rows, prefix, kv_lens, token_rows, positions, index
        )
        input_ids = self.tables.token_table[token_rows_d, positions_d].long()
        out_slots = self.tables.page_table[token_rows_d, positions_d].long()
        attn = AttentionBatch(
            table_rows=rows_d,
            prefix_lens=prefix_d,
            kv_lens=kv_d,
            out_slots=out_slots,
            page_table=self.tables.page_table,
            prefix_lens_cpu=batch.prefix_lens,
            kv_lens_cpu=kv_lens.tolist(),
        )
        ctx = ForwardContext(self.backend, pool, self.backend.prepare(attn))
        with forward_context(ctx):
            hidden = self.model.final_hidden(input_ids, positions_d, index_d)
            sizes = [len(p) for p in pooled.values()]
            num_logits = len(index) - sum(sizes)
            states = hidden[num_logits:].float().split(sizes)
            host = self.stream.to_host_async
            batch.pooled = {seq: host(s.sum(0)) for seq, s in zip(pooled, states, strict=True)}
            return self.model.lm_head.compute_logits(hidden[:num_logits]).float()

    def _sample(
        self, batch: ForwardBatch, logits: Tensor, vocab_mask: VocabMask | None
    ) -> PendingOutput:
        num_sampled = len(batch.sampled)
        scores = None
        if any(batch.num_prompt_scores):  # logits: the sampled rows, then the scored ones
            scores = PromptScores.of(batch, logits[num_sampled:], self.tables)
            logits = logits[:num_sampled]
        if not num_sampled:
            return PendingOutput([], ready=self.stream.record_event(), prompt_scores=scores)
        params = [p for p in batch.sampling if p is not None]
        if vocab_mask is None and all(map(_PLAIN_GREEDY, params)):
            # The usual benchmark batch: no sampling state to build, the raw logits' argmax.
            token_ids, token_scores = self.sampler.argmax(logits), None
        else:
            sb = SamplingBatch.for_batch(batch, self.model_config, self.tables, vocab_mask)
            token_ids, token_scores = self.sampler.sample(logits, sb)
        if get_tp_info().size > 1:
            # Ranks compute the same logits only up to float rounding (reduction order), so a
            # near-tie could pick different tokens and the ranks' KV caches would then diverge:
            # everyone takes rank 0's choice (and its logprobs, which every rank wants alike).
            token_ids = broadcast_from_primary(token_ids)
            if token_scores is not None:
                token_scores = token_scores.map(broadcast_from_primary)
        # The sampled token becomes the next input: write it where the next step will read it.
        if batch.is_decode:  # the forward's host tensors, a position on: no list per row
            rows, positions = batch.rows_and_positions
            rows_d, positions_d = self.stream.stage(torch.int64, rows, positions + 1)
        else:
            rows_d, positions_d = self.stream.stage(
                torch.int64, [batch.table_rows[i] for i in batch.sampled], batch.sampled_positions
            )
        self.tables.token_table[rows_d, positions_d] = token_ids.to(torch.int32)
        host = self.stream.to_host_async
        return PendingOutput(
            params,
            host(token_ids),
            None if token_scores is None else token_scores.map(host),
            self.stream.record_event(),
            scores,
        )
