"""The Triton attention backend against the torch-native one, on random paged batches, and a
whole greedy generation with each.

Interpreter: Triton decides between compiling a kernel and interpreting it when the kernel is
decorated, i.e. when `minisgl.kernels.triton_attention` is first imported, and reads the
variable again at launch. Without CUDA, this module sets TRITON_INTERPRET=1 before that import,
at collection (before any test can import the kernels through the registry), and leaves it set:
on a CPU-only machine nothing else runs Triton, and subprocesses that inherit it are unaffected.
The interpreted kernels run on CPU tensors, exactly but slowly (hence the small shapes). With
CUDA the variable is left alone, and the same checks run the compiled kernels on the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from minisgl import attention
from minisgl.attention import AttentionConfig, create_backend, resolve_backend_name
from minisgl.attention.base import AttentionBackend, AttentionBatch
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.config import CHOICES
from minisgl.kvcache.pool import KVPool, KVShape

HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = False
if HAVE_TRITON:
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from minisgl.attention.triton_backend import (
        MAX_DECODE_SPLITS,
        TritonBackend,
        TritonDecodeMetadata,
    )
    from minisgl.kernels import triton_attention as triton_kernels

    INTERPRETED = triton_kernels.INTERPRETER

requires_triton = pytest.mark.skipif(
    not HAVE_TRITON or (DEVICE.type == "cpu" and not INTERPRETED),
    reason="needs the triton package (pip install -e .[test], Linux), and on CPU its interpreter "
    "(triton_kernels was imported before this module could set TRITON_INTERPRET=1)",
)

FP32_ATOL = 1e-5
LOGPROB_ATOL = 1e-4  # fp32 logprobs of a whole model, as tests/test_model_parity.py allows
HALF_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
MAX_SEQ_LEN = 1024  # the backends' config: longer than any scenario


@dataclass(frozen=True)
class Scenario:
    """A batch of sequences (prefix_len, extend_len) over a shuffled paged pool."""

    seqs: list[tuple[int, int]]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    seed: int = 0


def _build(s: Scenario) -> tuple[KVPool, AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool with random cached prefixes; returns (pool, batch, q, k, v) for the new tokens."""
    g = torch.Generator().manual_seed(s.seed)
    num_seqs = len(s.seqs)
    kv_lens = [pre + ext for pre, ext in s.seqs]
    # One spare position per sequence: the graph test grows every sequence by a token.
    pages_per_seq = [-(-(kv + 1) // s.page_size) for kv in kv_lens]
    num_pages = sum(pages_per_seq) + 3  # a few pages nobody uses
    pool = KVPool(KVShape(1, s.num_kv_heads, s.head_dim), num_pages, s.page_size, s.dtype, DEVICE)
    # Unused slots hold random values too: reading a wrong slot cannot go unnoticed.
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    width = max(pages_per_seq) * s.page_size
    num_rows = num_seqs + 2
    page_table = torch.zeros(num_rows, width, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=g)[:num_seqs]
    pages = torch.randperm(num_pages, generator=g).tolist()  # non-contiguous pages
    offsets = torch.arange(width) % s.page_size
    for i, n in enumerate(pages_per_seq):
        seq_pages = torch.tensor([pages.pop() for _ in range(n)])
        slots = seq_pages.repeat_interleave(s.page_size) * s.page_size + offsets[: n * s.page_size]
        page_table[rows[i], : n * s.page_size] = slots.to(torch.int32)
    page_table = page_table.to(DEVICE)
    out_slots = torch.cat(
        [page_table[rows[i], pre : pre + ext].long() for i, (pre, ext) in enumerate(s.seqs)]
    )
    num_tokens = out_slots.numel()
    q = torch.randn(num_tokens, s.num_heads, s.head_dim, generator=g).to(DEVICE, s.dtype)
    k = torch.randn(num_tokens, s.num_kv_heads, s.head_dim, generator=g).to(DEVICE, s.dtype)
    v = torch.randn(num_tokens, s.num_kv_heads, s.head_dim, generator=g).to(DEVICE, s.dtype)
    batch = AttentionBatch(
        table_rows=rows.to(DEVICE),
        prefix_lens=torch.tensor([pre for pre, _ in s.seqs], device=DEVICE),
        kv_lens=torch.tensor(kv_lens, device=DEVICE),
        out_slots=out_slots,
        page_table=page_table,
        prefix_lens_cpu=[pre for pre, _ in s.seqs],
        kv_lens_cpu=kv_lens,
    )
    return pool, batch, q, k, v


def _run(backend: AttentionBackend, pool, batch, q, k, v, metadata=None) -> torch.Tensor:
    meta = backend.prepare(batch) if metadata is None else metadata
    return backend.forward(q, k, v, 0, pool, meta)


def _reference(pool, batch, q, k, v) -> torch.Tensor:
    """Torch-native attention in fp32 (16-bit inputs are upcast: the kernels accumulate in fp32)."""
    pool32 = KVPool(pool.shape, pool.num_pages, pool.page_size, torch.float32, pool.buffer.device)
    pool32.buffer.copy_(pool.buffer)
    return _run(TorchNativeBackend(), pool32, batch, q.float(), k.float(), v.float())


def _triton(s: Scenario) -> TritonBackend:
    cfg = AttentionConfig(
        s.num_heads, s.num_kv_heads, s.head_dim, s.page_size, MAX_SEQ_LEN, s.dtype, DEVICE
    )
    return TritonBackend(cfg)


def _split_in(backend: TritonBackend, batch: AttentionBatch, splits: int) -> TritonDecodeMetadata:
    """The backend's metadata for a decode-only batch, with `splits` KV splits per sequence
    (the backend picks them from the batch size)."""
    return dataclasses.replace(backend.prepare(batch), num_splits=splits)


def _check(s: Scenario, decode_splits: int | None = None) -> None:
    pool, batch, q, k, v = _build(s)
    backend = _triton(s)
    meta = None if decode_splits is None else _split_in(backend, batch, decode_splits)
    got = _run(backend, pool, batch, q, k, v, meta)
    want = _reference(pool, batch, q, k, v)
    assert got.dtype == s.dtype and got.shape == q.shape
    atol = FP32_ATOL if s.dtype == torch.float32 else HALF_ATOL[s.dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


# (prefix_len, extend_len): fresh prompts, chunks after a cached prefix (crossing BLOCK_N = 64
# and several query blocks), and decodes, in one batch.
MIXED = [(0, 37), (20, 13), (70, 1), (5, 1), (0, 1), (33, 80), (64, 2)]
DECODES = [(0, 1), (150, 1), (63, 1), (64, 1), (9, 1)]
# The scheduler's order: decodes first (the decode kernel takes them), then prefill chunks (the
# extend kernel), a one-token chunk among them.
DECODES_FIRST = [(70, 1), (5, 1), (0, 1), (150, 1), (0, 37), (20, 13), (64, 1), (33, 80)]


@requires_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_torch(page_size, num_heads, num_kv_heads, head_dim):
    _check(Scenario(MIXED, num_heads, num_kv_heads, head_dim, page_size))


@requires_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (8, 2)])
def test_mixed_batch_decodes_take_the_decode_kernel(page_size, num_heads, num_kv_heads):
    s = Scenario(DECODES_FIRST, num_heads, num_kv_heads, 64, page_size)
    metadata = _triton(s).prepare(_build(s)[1])
    assert metadata.decodes is not None and metadata.decodes.table_rows.numel() == 4
    assert metadata.prefix_lens.tolist() == [0, 20, 64, 33]
    _check(s)


@requires_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_matches_torch(page_size, num_heads, num_kv_heads, head_dim):
    _check(Scenario(DECODES, num_heads, num_kv_heads, head_dim, page_size))


@requires_triton
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_decode_splits_merge_exactly(splits):
    # 150 keys in 4 splits: three full-tile splits and an empty one; 16 splits: mostly empty.
    assert splits <= MAX_DECODE_SPLITS
    _check(Scenario(DECODES, seed=1), decode_splits=splits)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_half_precision(dtype, seqs):
    _check(Scenario(seqs, dtype=dtype, page_size=16))


@requires_triton
@pytest.mark.parametrize("head_dim", [80, 256])
def test_other_head_dims(head_dim):
    # 80: padded to a 128-wide tile with masked columns; 256: the smaller extend query block.
    _check(Scenario([(10, 20), (40, 1)], head_dim=head_dim))
    _check(Scenario(DECODES[:3], head_dim=head_dim))


@requires_triton
def test_strided_query():
    # The model passes q as a view of the fused qkv projection (token stride > heads * dim).
    s = Scenario(MIXED)
    pool, batch, q, k, v = _build(s)
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 16, device=DEVICE)], dim=1)
    q_view = qkv[:, : q[0].numel()].view(q.shape)
    assert not q_view.is_contiguous()
    got = _run(_triton(s), pool, batch, q_view, k, v)
    torch.testing.assert_close(got, _reference(pool, batch, q, k, v), atol=FP32_ATOL, rtol=0)


def _padded(batch: AttentionBatch, dummy_row: int, dummy_slot: int, pad: int) -> AttentionBatch:
    """`batch` plus `pad` decodes of KV length 1 on the dummy row, as CUDA graphs pad."""
    kv_lens = batch.kv_lens_cpu + [1] * pad
    batch.page_table[dummy_row, 0] = dummy_slot
    device = batch.kv_lens.device
    return AttentionBatch(
        table_rows=torch.cat([batch.table_rows, torch.full((pad,), dummy_row, device=device)]),
        prefix_lens=torch.tensor([kv - 1 for kv in kv_lens], device=device),
        kv_lens=torch.tensor(kv_lens, device=device),
        out_slots=torch.cat([batch.out_slots, torch.full((pad,), dummy_slot, device=device)]),
        page_table=batch.page_table,
        prefix_lens_cpu=[kv - 1 for kv in kv_lens],
        kv_lens_cpu=kv_lens,
    )


@requires_triton
def test_padded_decode_leaves_real_rows_unchanged():
    s = Scenario(DECODES, page_size=16)
    pool, batch, q, k, v = _build(s)
    backend = _triton(s)
    plain = _run(backend, pool, batch, q, k, v, _split_in(backend, batch, 4))
    pad = 3
    # The scenario leaves table rows and pages unused: padding points at one of each.
    used_rows = batch.table_rows.tolist()
    used_slots = {
        slot
        for row, kv_len in zip(used_rows, batch.kv_lens_cpu, strict=True)
        for slot in batch.page_table[row, :kv_len].tolist()
    }
    dummy_row = next(r for r in range(batch.page_table.shape[0]) if r not in used_rows)
    dummy_slot = next(slot for slot in range(pool.num_slots) if slot not in used_slots)
    padded = _padded(batch, dummy_row, dummy_slot, pad)
    pq, pk, pv = (torch.cat([t, torch.randn_like(t[:pad])]) for t in (q, k, v))
    out = _run(backend, pool, padded, pq, pk, pv, _split_in(backend, padded, 4))
    assert torch.equal(out[: batch.num_seqs], plain)
    assert torch.isfinite(out).all()


@requires_triton
def test_graph_hooks_refresh_from_static_buffers():
    """The graph path without a GPU: metadata over static buffers; the engine rewrites the
    buffers between replays and the same scratch serves every batch size."""
    s = Scenario(DECODES, page_size=16)
    pool, batch, q, k, v = _build(s)
    backend = _triton(s)
    backend.init_graph_state(max_batch_size=8)
    meta = backend.prepare_graph(batch, capturing=True)
    first = _run(backend, pool, batch, q, k, v, metadata=meta)
    torch.testing.assert_close(first, _reference(pool, batch, q, k, v), atol=FP32_ATOL, rtol=0)
    scratch = backend._graph_scratch
    assert scratch is not None and scratch[0].shape[0] == 8
    # Next "replay": every sequence one token longer, written in place into the same buffers.
    batch.kv_lens.add_(1)
    batch.out_slots.copy_(batch.page_table[batch.table_rows, batch.kv_lens - 1].long())
    longer = AttentionBatch(
        table_rows=batch.table_rows,
        prefix_lens=batch.kv_lens - 1,
        kv_lens=batch.kv_lens,
        out_slots=batch.out_slots,
        page_table=batch.page_table,
        prefix_lens_cpu=list(batch.kv_lens_cpu),
        kv_lens_cpu=[kv + 1 for kv in batch.kv_lens_cpu],
    )
    meta = backend.prepare_graph(longer, capturing=False)
    second = _run(backend, pool, longer, q, k, v, metadata=meta)
    assert backend._graph_scratch is scratch
    torch.testing.assert_close(second, _reference(pool, longer, q, k, v), atol=FP32_ATOL, rtol=0)
    # A smaller graph: the first two sequences, as leading slices of the same static buffers.
    small = AttentionBatch(
        table_rows=longer.table_rows[:2],
        prefix_lens=longer.prefix_lens[:2],
        kv_lens=longer.kv_lens[:2],
        out_slots=longer.out_slots[:2],
        page_table=longer.page_table,
        prefix_lens_cpu=longer.prefix_lens_cpu[:2],
        kv_lens_cpu=longer.kv_lens_cpu[:2],
    )
    meta = backend.prepare_graph(small, capturing=True)
    third = _run(backend, pool, small, q[:2], k[:2], v[:2], metadata=meta)
    assert backend._graph_scratch is scratch
    torch.testing.assert_close(third, second[:2], atol=FP32_ATOL, rtol=0)
    with pytest.raises(ValueError, match="decode-only"):
        backend.prepare_graph(_build(Scenario(MIXED))[1], capturing=True)


# ---- the registry ------------------------------------------------------------------------------


def test_auto_picks_by_device_and_installed_packages(monkeypatch):
    cuda = torch.device("cuda", 0)
    bf16 = torch.bfloat16
    assert resolve_backend_name("auto", torch.device("cpu"), bf16) == "torch"
    installed: set[str] = set()
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args):
        if name in ("flashinfer", "triton"):
            return object() if name in installed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    assert resolve_backend_name("auto", cuda, bf16) == "torch"
    installed.add("triton")
    assert resolve_backend_name("auto", cuda, bf16) == "triton"
    installed.add("flashinfer")
    assert resolve_backend_name("auto", cuda, bf16) == "flashinfer"
    # FlashInfer has no fp32 kernels: fp32 on CUDA goes to Triton.
    assert resolve_backend_name("auto", cuda, torch.float32) == "triton"
    installed.clear()
    with pytest.raises(ValueError, match="'triton' needs the 'triton' package"):
        resolve_backend_name("triton", cuda, bf16)
    # Names come checked by ServerArgs: its choices are the registry's.
    assert set(CHOICES["attention_backend"]) == {"auto", *attention._REGISTRY}


@requires_triton
@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal")
def test_triton_on_cpu_needs_the_interpreter():
    code = (
        "import torch\nfrom minisgl.attention import AttentionConfig, create_backend\n"
        "cfg = AttentionConfig(4, 2, 64, 1, 128, torch.float32, torch.device('cpu'))\n"
        "create_backend('triton', cfg)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr
    cfg = AttentionConfig(4, 2, 64, 1, 128, torch.float32, DEVICE)
    assert isinstance(create_backend("triton", cfg), TritonBackend)  # interpreted here


# ---- end to end --------------------------------------------------------------------------------


@requires_triton
def test_generation_matches_torch_backend(tiny_qwen3):
    from minisgl import LLM, SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 5000, (60,), generator=g).tolist()  # > one 64-key tile
    prompts = [
        torch.randint(0, 5000, (11,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (5,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (9,), generator=g).tolist(),  # reuses the cached prefix
        [7],
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs, logprobs = {}, {}
    for name in ("torch", "triton"):
        llm = LLM(
            str(tiny_qwen3),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=name,
            num_pages=128,
            page_size=4,
            max_running_requests=4,
        )
        try:
            engine = llm.scheduler.engine
            assert type(engine.backend).__name__.lower().startswith(name)
            if name == "triton":  # the fused CPU decode step would bypass the backend
                assert engine.model.cpu_decode_stack is None
            results = llm.generate(prompts, params)
            outputs[name] = [o.token_ids for o in results]
            logprobs[name] = torch.tensor([[lp.logprob for lp in o.logprobs] for o in results])
            llm.check_page_accounting()
        finally:
            llm.shutdown()
    assert outputs["triton"] == outputs["torch"]
    assert all(len(ids) == 8 for ids in outputs["triton"])
    torch.testing.assert_close(logprobs["triton"], logprobs["torch"], atol=LOGPROB_ATOL, rtol=0)
