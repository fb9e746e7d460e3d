"""The fused Triton layer kernels (minisgl/kernels/triton_fused.py) against the torch reference
they replace, and a whole generation through them.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton); with one they compile for CUDA. In 16-bit dtypes the kernels
round where the torch ops do, so they must agree with the reference bit for bit except where a
mean's summation order or an `exp` tips a rounding: rarely, and by one unit in the last place
of that intermediate (two of the output, once a product carries it).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (Linux: pip install triton)")
if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from minisgl.kernels import gpu  # noqa: E402
from minisgl.kernels import triton_fused as tf  # noqa: E402
from minisgl.layers.norm import RMSNorm, rms_norm  # noqa: E402
from minisgl.layers.rope import RopeConfig, RotaryEmbedding, qk_norm_rope  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_ATOL = 2e-6  # fp32: only the mean's summation order differs
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
MAX_MISMATCH_SHARE = 0.02  # 16-bit: share of elements allowed to differ at all
EPS = 1e-6


@pytest.fixture(autouse=True)
def reference_on_torch_ops(monkeypatch):
    """The references below are the layers' torch paths: the CPU C kernels stay out of them."""
    monkeypatch.setenv("MINISGL_CPU_KERNELS", "0")
    from minisgl.kernels import cpu

    cpu.get.cache_clear()
    yield
    cpu.get.cache_clear()


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=1e-6)
        return
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=2 * ULP[want.dtype], atol=1e-6)
    mismatches = (g != w).float().mean().item()
    assert mismatches <= MAX_MISMATCH_SHARE, f"{mismatches:.1%} of elements differ"


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _norm(size: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(size, EPS).to(DEVICE)
    norm.weight.data = 1 + _randn(size, dtype=dtype, seed=seed, scale=0.3)
    return norm


# ---- each kernel against its reference ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (33, 1000)], ids=str)
def test_rmsnorm(dtype, shape):
    norm = _norm(shape[1], dtype, seed=1)
    x = _randn(*shape, dtype=dtype, seed=2, scale=3.0)
    _assert_matches(tf.rmsnorm(x, norm.weight, EPS), rms_norm(x, norm.weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_updates_the_residual(dtype):
    norm = _norm(96, dtype, seed=1)
    x, residual = _randn(9, 96, dtype=dtype, seed=2), _randn(9, 96, dtype=dtype, seed=3)
    want_residual = x + residual
    want = rms_norm(want_residual, norm.weight, EPS)
    got = tf.rmsnorm(x, norm.weight, EPS, residual)
    assert torch.equal(residual, want_residual)  # a sum in the dtype: exact
    _assert_matches(got, want)


def _qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as the attention layer gets them: strided views into one fused projection."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4, scale=2.0)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "qk_norm"),
    [(4, 2, 64, True), (16, 8, 128, True), (6, 2, 80, False), (3, 3, 32, False)],
    ids=lambda v: str(v),
)
def test_qk_norm_rope(dtype, heads, kv_heads, head_dim, qk_norm):
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(1e6)).to(DEVICE)
    positions = torch.tensor([0, 1, 17, 300, 511, 64], device=DEVICE)
    q, k, _ = _qkv_views(len(positions), heads, kv_heads, head_dim, dtype)
    q_norm, k_norm = _norm(head_dim, dtype, seed=5), _norm(head_dim, dtype, seed=6)
    weights = (q_norm.weight, k_norm.weight) if qk_norm else (None, None)
    caches = (rope.cos_cache, rope.sin_cache)
    want_q, want_k = qk_norm_rope(q, k, positions, *caches, *weights, EPS)
    got_q, got_k = tf.qk_norm_rope(q, k, positions, *caches, *weights, EPS)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    _assert_matches(got_q, want_q)
    _assert_matches(got_k, want_k)


def test_scaled_rope_caches():
    """yarn scales cos/sin; the kernel reads whatever the cache holds."""
    cfg = RopeConfig(1e4, "yarn", {"factor": 4.0, "original_max_position_embeddings": 128})
    rope = RotaryEmbedding(64, 512, cfg).to(DEVICE)
    positions = torch.arange(0, 512, 97, device=DEVICE)
    q, k, _ = _qkv_views(len(positions), 4, 2, 64, torch.float32)
    want_q, want_k = qk_norm_rope(q, k, positions, rope.cos_cache, rope.sin_cache, None, None, 0)
    got_q, got_k = tf.qk_norm_rope(q, k, positions, rope.cos_cache, rope.sin_cache, None, None, 0)
    _assert_matches(got_q, want_q)
    _assert_matches(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 48), (5, 2 * 1500)], ids=str)
def test_silu_mul(dtype, shape):
    gate_up = _randn(*shape, dtype=dtype, seed=7, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_matches(tf.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_writes_only_the_given_slots(dtype):
    _, k, v = _qkv_views(5, 4, 2, 64, dtype)
    k_cache = torch.zeros(40, 2, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 39, 0, 17, 4], device=DEVICE)
    assert tf.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    # A token's heads not one contiguous run: refused (the caller falls back), nothing written.
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    before = k_cache.clone()
    assert not tf.store_kv(k_strided, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)


def test_empty_batches():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert tf.rmsnorm(x, w, EPS).shape == (0, 64)
    assert tf.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


# ---- the switch, and a whole generation ---------------------------------------------------------


def test_switch(monkeypatch):
    cpu = torch.device("cpu")
    try:
        monkeypatch.setenv(gpu.ENABLE_ENV, "0")
        gpu.reset()
        assert gpu.triton_kernels("triton_fused", cpu) is None
        monkeypatch.setenv(gpu.ENABLE_ENV, "auto")
        gpu.reset()
        assert (
            gpu.triton_kernels("triton_fused", cpu) is None
        )  # on the CPU: CPU kernels or torch ops
        if ON_CUDA:
            assert gpu.triton_kernels("triton_fused", torch.device("cuda")) is tf
        monkeypatch.setenv(gpu.ENABLE_ENV, "1")
        gpu.reset()
        assert gpu.triton_kernels("triton_fused", cpu) is tf
    finally:
        monkeypatch.delenv(gpu.ENABLE_ENV)
        gpu.reset()


@pytest.mark.parametrize("graph_bs", [None, 4], ids=["eager", "padded"])
def test_generation_through_the_fused_kernels(tiny_qwen3, monkeypatch, graph_bs):
    """Greedy tokens and logprobs of a Qwen3 (q/k norm) model with every layer's norm, rope,
    activation and KV store in the fused kernels equal those of the torch ops; also through the
    CUDA-graph runner's padded decode path (run eagerly here), whose padding rows store K/V
    into the dummy page."""
    from minisgl import LLM, SamplingParams

    calls = dict.fromkeys(("rmsnorm", "qk_norm_rope", "silu_mul", "store_kv"), 0)
    for name in calls:
        original = getattr(tf, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(tf, name, counted)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 5000, (n,), generator=g).tolist() for n in (13, 40, 1)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    results = {}
    try:
        for setting in ("0", "1"):
            monkeypatch.setenv(gpu.ENABLE_ENV, setting)
            gpu.reset()
            with LLM(str(tiny_qwen3), device=DEVICE.type, dtype="float32",
                     attention_backend="triton", num_pages=64, page_size=4,
                     max_running_requests=4, cuda_graph_max_bs=graph_bs) as llm:  # fmt: skip
                outs = llm.generate(prompts, params)
                llm.check_page_accounting()
            results[setting] = (
                [o.token_ids for o in outs],
                torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs]),
            )
            if setting == "0":
                assert not any(calls.values()), calls
    finally:
        monkeypatch.delenv(gpu.ENABLE_ENV)
        gpu.reset()
    assert all(calls.values()), calls  # every kernel ran
    assert results["1"][0] == results["0"][0]
    torch.testing.assert_close(results["1"][1], results["0"][1], atol=1e-4, rtol=0)
