"""The CUDA path, on a GPU only (skipped elsewhere; scripts/gpu_check.sh runs it on the device).

- each CUDA attention backend against the torch-native one on random pools and batches;
- logits against transformers on a random Qwen3-0.6B-shaped checkpoint, fp32 and bf16;
- CUDA graphs on/off and overlap on/off give the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.attention import create_backend
from minisgl.attention.base import AttentionBatch, AttentionConfig
from minisgl.kvcache.pool import KVPool, KVShape
from tests.conftest import qwen3_tokenizer_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip
# Weights a little larger than HF's default init: logits far from uniform, so greedy picks are
# rarely near-ties (the median top-2 gap is ~0.3 at this scale).
INIT_STD = 0.05
NUM_NEW_TOKENS = 12
TOP_K = 5


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _backends(dtype: torch.dtype) -> list:
    marks = {
        "flashinfer": pytest.mark.skipif(not _has("flashinfer"), reason="flashinfer missing"),
        "triton": pytest.mark.skipif(not _has("triton"), reason="triton missing"),
    }
    names = ["triton"] + (["flashinfer"] if dtype != torch.float32 else [])
    return [pytest.param(n, marks=marks[n], id=n) for n in names]


# ---- backends against torch-native ---------------------------------------------------------------


def _random_case(
    page_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, decode: bool
) -> tuple[AttentionConfig, KVPool, AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = random.Random(page_size * 31 + head_dim + group)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    num_pages, width, num_rows = 2048, 1024, 8
    cfg = AttentionConfig(num_kv_heads * group, num_kv_heads, head_dim, page_size, width, dtype,
                          device)  # fmt: skip
    pool = KVPool(KVShape(1, num_kv_heads, head_dim), num_pages, page_size, dtype, device)
    pool.buffer.normal_()
    page_table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
    pages = list(range(num_pages))
    rng.shuffle(pages)  # non-contiguous pages
    if decode:
        shape = [(rng.randint(1, 300), 1) for _ in range(6)]
    else:  # prefill chunks with and without cached prefixes, mixed with decodes
        shape = [(0, 37), (64, 20), (5, 1), (130, 70), (0, 1), (17, 1), (250, 3)]
    prefix_lens, kv_lens, out_slots = [], [], []
    for row, (prefix, extend) in enumerate(shape):
        kv_len = prefix + extend
        owned = [pages.pop() for _ in range(-(-kv_len // page_size))]
        slots = torch.tensor(
            [p * page_size + o for p in owned for o in range(page_size)][:kv_len], device=device
        )
        page_table[row, :kv_len] = slots.int()
        prefix_lens.append(prefix)
        kv_lens.append(kv_len)
        out_slots.append(slots[prefix:])
    num_tokens = sum(e for _, e in shape)
    batch = AttentionBatch(
        table_rows=torch.arange(len(shape), device=device),
        prefix_lens=torch.tensor(prefix_lens, device=device),
        kv_lens=torch.tensor(kv_lens, device=device),
        out_slots=torch.cat(out_slots),
        page_table=page_table,
        prefix_lens_cpu=prefix_lens,
        kv_lens_cpu=kv_lens,
    )
    q = torch.randn(num_tokens, cfg.num_qo_heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    return cfg, pool, batch, q, k, v


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("name", _backends(torch.bfloat16))
def test_backend_matches_torch_native(name, group, page_size, decode):
    cfg, pool, batch, q, k, v = _random_case(page_size, 2, group, 128, torch.bfloat16, decode)
    reference_pool = KVPool(KVShape(1, 2, 128), pool.num_pages, page_size, torch.float32,
                            cfg.device)  # fmt: skip
    reference_pool.buffer.copy_(pool.buffer.float())
    backend = create_backend(name, cfg)
    out = backend.forward(q, k, v, 0, pool, backend.prepare(batch))
    torch_cfg = AttentionConfig(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, page_size,
                                cfg.max_seq_len, torch.float32, cfg.device)  # fmt: skip
    ref_backend = create_backend("torch", torch_cfg)
    ref = ref_backend.forward(
        q.float(), k.float(), v.float(), 0, reference_pool, ref_backend.prepare(batch)
    )
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool.buffer.float(), reference_pool.buffer, atol=1e-2, rtol=0)


# ---- logits against transformers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3_06b")
    config = Qwen3Config(vocab_size=151936, max_position_embeddings=4096, eos_token_id=151645,
                         **QWEN3_06B)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, INIT_STD)
    model.to(torch.bfloat16).save_pretrained(path)  # bf16 values: exact in both dtypes
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 5000, (60,), generator=g).tolist()
    return [
        torch.randint(0, 5000, (9,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (13,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (40,), generator=g).tolist(),
        torch.randint(0, 5000, (150,), generator=g).tolist(),
    ]


def _hf_logprobs(model_dir: Path, dtype: torch.dtype, seqs: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = hf(torch.tensor([ids], device="cuda")).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    del hf
    torch.cuda.empty_cache()
    return out


def _generate(model_dir: Path, after=None, **options) -> list:
    """`after(llm)`, if given, runs once the outputs are in (the LLM still open)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_K)  # fmt: skip
    opts = dict(num_pages=2048, page_size=16, max_running_requests=8, **options)
    with LLM(str(model_dir), **opts) as llm:
        outs = llm.generate(_prompts(), params)
        llm.check_page_accounting()
        if after is not None:
            after(llm)
    return outs


def _chosen_logprob_errors(outs, reference: list[torch.Tensor]) -> torch.Tensor:
    """|our logprob - reference logprob| of every generated token (teacher-forced reference)."""
    errors = []
    for prompt, out, ref in zip(_prompts(), outs, reference, strict=True):
        for step, lp in enumerate(out.logprobs):
            errors.append(abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()))
    return torch.tensor(errors)


@pytest.mark.parametrize("name", [*_backends(torch.float32), "torch"])
def test_fp32_matches_transformers(qwen3_06b, name):
    outs = _generate(qwen3_06b, dtype="float32", attention_backend=name)
    seqs = [p + o.token_ids for p, o in zip(_prompts(), outs, strict=True)]
    reference = _hf_logprobs(qwen3_06b, torch.float32, seqs)
    for prompt, out, ref in zip(_prompts(), outs, reference, strict=True):
        # HF's greedy choice at every step of our sequence: the same tokens (teacher-forced).
        hf_greedy = ref[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        assert out.token_ids == hf_greedy
    assert _chosen_logprob_errors(outs, reference).max() < 2e-3


@pytest.mark.parametrize("name", _backends(torch.bfloat16))
def test_bf16_close_to_transformers(qwen3_06b, name):
    """bf16 can't match fp32 exactly: our error against HF fp32 must be of the size of HF's own
    bf16 error on the same sequences."""
    outs = _generate(qwen3_06b, dtype="bfloat16", attention_backend=name)
    seqs = [p + o.token_ids for p, o in zip(_prompts(), outs, strict=True)]
    exact = _hf_logprobs(qwen3_06b, torch.float32, seqs)
    hf_bf16 = _hf_logprobs(qwen3_06b, torch.bfloat16, seqs)
    ours = _chosen_logprob_errors(outs, exact)
    theirs = torch.tensor([
        abs(b[len(p) - 1 + s, t].item() - e[len(p) - 1 + s, t].item())
        for p, o, e, b in zip(_prompts(), outs, exact, hf_bf16, strict=True)
        for s, t in enumerate(o.token_ids)
    ])  # fmt: skip
    print(f"{name} bf16 |logprob error| mean {ours.mean():.4f} max {ours.max():.4f}; "
          f"HF bf16 mean {theirs.mean():.4f} max {theirs.max():.4f}")  # fmt: skip
    assert ours.mean() <= 3 * theirs.mean() + 0.02
    assert ours.max() <= 3 * theirs.max() + 0.1


# ---- graphs and overlap do not change tokens ----------------------------------------------------

# bf16: padded graph batches change GEMM shapes and so rounding; a token may flip only where the
# reference's top two candidates are this close (a near-tie), and logprobs agree up to there.
NEAR_TIE_LOGPROB_GAP = 0.1
BF16_LOGPROB_ATOL = 0.05


def _assert_same_generation(outs, reference, exact: bool, label: object) -> None:
    for out, ref in zip(outs, reference, strict=True):
        if exact:
            assert out.token_ids == ref.token_ids, label
            continue
        for step, (got, want) in enumerate(zip(out.logprobs, ref.logprobs, strict=True)):
            if got.token_id != want.token_id:
                gap = want.top[0][1] - want.top[1][1]
                assert gap < NEAR_TIE_LOGPROB_GAP, (label, step, got, want)
                break  # the sequences differ from here on: nothing more to compare
            assert abs(got.logprob - want.logprob) < BF16_LOGPROB_ATOL, (label, step, got, want)


# (backend, dtype): fp32 on Triton (tokens compared exactly), bf16 on each backend
TOKEN_CASES = [
    pytest.param("triton", "float32", marks=_backends(torch.float32)[0].marks, id="triton"),
    *[pytest.param(p.values[0], "bfloat16", marks=p.marks, id=p.id + "-bf16")
      for p in _backends(torch.bfloat16)],
]  # fmt: skip


@pytest.mark.parametrize(("name", "dtype"), TOKEN_CASES)
def test_graphs_and_overlap_keep_tokens(qwen3_06b, name, dtype):
    runs = {}
    for graphs in (True, False):
        for overlap in ("on", "off"):
            runs[(graphs, overlap)] = _generate(
                qwen3_06b, dtype=dtype, attention_backend=name, overlap=overlap,
                cuda_graph_max_bs=None if graphs else 0,
            )  # fmt: skip
    baseline = runs[(False, "off")]
    for key, outs in runs.items():
        _assert_same_generation(outs, baseline, dtype == "float32", key)


@pytest.mark.parametrize("name", _backends(torch.bfloat16))
def test_graphs_are_captured_and_replayed(qwen3_06b, name):
    with LLM(str(qwen3_06b), dtype="bfloat16", num_pages=1024, page_size=16,
             max_running_requests=16, attention_backend=name) as llm:  # fmt: skip
        engine = llm.scheduler.engine
        assert engine.graphs is not None and engine.graphs._graphs
        replays = 0
        original = torch.cuda.CUDAGraph.replay

        def counting_replay(graph):
            nonlocal replays
            replays += 1
            return original(graph)

        torch.cuda.CUDAGraph.replay = counting_replay  # type: ignore[method-assign]
        try:
            llm.generate(_prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
        finally:
            torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]
        assert replays >= 6  # every decode-only step after the prefills


@pytest.mark.parametrize(("name", "dtype"), TOKEN_CASES)
def test_speculative_verify_steps_keep_tokens(qwen3_06b, name, dtype):
    """n-gram drafts verified in decode-shaped batches, CUDA graphs on, against plain decoding
    with graphs off (docs/speculative.md): the same tokens (bf16: up to a near-tie)."""
    baseline = _generate(qwen3_06b, dtype=dtype, attention_backend=name, cuda_graph_max_bs=0)
    seen = {}
    outs = _generate(
        qwen3_06b, lambda llm: seen.update(graphs=llm.scheduler.engine.graphs,
                                           stats=llm.scheduler.stats()),
        dtype=dtype, attention_backend=name, speculative_algorithm="ngram",
        speculative_ngram_min_match=1,
    )  # fmt: skip
    assert seen["graphs"] is not None
    stats = seen["stats"]
    # (a random model's greedy text repeats itself: 1-token matches find drafts)
    assert stats.spec_verify_steps_total > 0
    print(f"{name} {dtype}: {stats.spec_verify_steps_total} verify steps, "
          f"{stats.spec_accepted_tokens_total} drafts accepted")  # fmt: skip
    _assert_same_generation(outs, baseline, dtype == "float32", (name, dtype))


# ---- the fused layer kernels do not change tokens ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_kernels_keep_tokens(qwen3_06b, dtype, monkeypatch):
    """Norms, rope, SiLU and the KV store in the fused Triton kernels (the CUDA default) against
    the same model in torch ops (MINISGL_FUSED_KERNELS=0), graphs on."""
    pytest.importorskip("triton")
    from minisgl.kernels import gpu

    runs = {}
    try:
        for setting in ("0", "auto"):
            monkeypatch.setenv(gpu.ENABLE_ENV, setting)
            gpu.reset()
            runs[setting] = _generate(qwen3_06b, dtype=dtype, attention_backend="triton")
    finally:
        monkeypatch.delenv(gpu.ENABLE_ENV)
        gpu.reset()
    _assert_same_generation(runs["auto"], runs["0"], dtype == "float32", dtype)


def test_scoring_penalties_and_bias_on_cuda(qwen3_06b):
    """The sampling features on CUDA, in one batch: prompt logprobs against transformers, a
    penalized greedy reply against transformers' logits with the penalties written out, a
    +100 logit_bias, and a seeded draw (the Triton sampling kernel)."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
    params = [
        SamplingParams(max_tokens=0, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **penalties),
        SamplingParams(temperature=0.7, seed=3, max_tokens=4, logit_bias={777: 100}),
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
    ]
    opts = dict(dtype="float32", num_pages=2048, page_size=16, max_running_requests=8)
    with LLM(str(qwen3_06b), **opts) as llm:
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts[3:], params[3:])[0]
        llm.check_page_accounting()
    ref = _hf_logprobs(qwen3_06b, torch.float32, [prompts[0]])[0]
    got = torch.tensor([e.logprob for e in outs[0].prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])]
    assert outs[0].token_ids == [] and (got - want).abs().max() < 2e-3
    hf = AutoModelForCausalLM.from_pretrained(qwen3_06b, dtype=torch.float32).cuda().eval()
    ids = list(prompts[1])
    with torch.no_grad():
        for _ in range(8):
            logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            for tok in set(ids):
                r = penalties["repetition_penalty"]
                logits[tok] = logits[tok] / r if logits[tok] > 0 else logits[tok] * r
            output = ids[len(prompts[1]) :]
            for tok in set(output):
                logits[tok] -= 0.5 * output.count(tok) + 0.5
            ids.append(int(logits.argmax()))
    assert outs[1].token_ids == ids[len(prompts[1]) :]
    assert outs[2].token_ids == [777] * 4
    assert len(set(outs[3].token_ids)) > 1 and again.token_ids == outs[3].token_ids  # seeded
