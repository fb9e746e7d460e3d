"""The Triton sampling kernel (minisgl/kernels/triton_sampling.py) against the sampler's torch
formula, and the sampler dispatching to it.

Without a GPU it runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
with one it compiles for CUDA. The kernel races in log space (logits / t - log(-log u)) where
the torch formula divides probabilities (softmax(logits / t) / -log u): the same argmax up to
float rounding, so on these fixed inputs the tokens must be equal.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (Linux: pip install triton)")
if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import sampler  # noqa: E402
from minisgl.engine.device import ComputeStream  # noqa: E402
from minisgl.engine.sampling_batch import SamplingBatch  # noqa: E402
from minisgl.kernels import gpu  # noqa: E402
from minisgl.kernels import triton_sampling as ts  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
QWEN3_VOCAB = 151936


def _torch_draw(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """sampler.py's formula, written out (no kernel of any kind)."""
    logits = logits.float()
    probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
    u = sampler.seeded_uniform(seeds, positions, logits.shape[-1])
    sampled = (probs / -torch.log(u)).argmax(dim=-1)
    return torch.where(temps == 0, logits.argmax(dim=-1), sampled)


def _inputs(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temps = torch.tensor([0.0, 0.6, 1.0, 2.0, 0.01, 1.0, 0.0, 5.0] * rows)[:rows]
    seeds = torch.randint(-(2**40), 2**40, (rows,), generator=g)
    positions = torch.randint(0, 100_000, (rows,), generator=g)
    return logits, temps, seeds, positions


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 1000, ts.BLOCK])
def test_kernel_draws_the_torch_formulas_tokens(vocab):
    logits, temps, seeds, positions = _inputs(8, vocab)
    got = ts.sample(*_on_device(logits, temps, seeds, positions))
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == _torch_draw(logits, temps, seeds, positions).tolist()


def test_kernel_uniforms_are_the_samplers_bit_for_bit():
    """Equal logits at temperature 1: the winner is the id with the largest uniform (the
    lowest such id on a tie), so every row checks the kernel's hash against seeded_uniform."""
    rows = 16
    _, _, seeds, positions = _inputs(rows, 1, seed=1)
    flat = torch.zeros(rows, QWEN3_VOCAB)
    got = ts.sample(*_on_device(flat, torch.ones(rows), seeds, positions))
    u = sampler.seeded_uniform(seeds, positions, QWEN3_VOCAB)
    assert got.cpu().tolist() == u.argmax(dim=-1).tolist()


def test_kernel_on_strided_16_bit_rows_with_masked_tokens():
    """A row slice of wider bf16 logits (the stride the kernel must honour), with most of the
    vocabulary at -inf as a grammar mask leaves it: only allowed tokens are drawn."""
    rows, vocab = 8, 5000
    logits, temps, seeds, positions = _inputs(rows, vocab, seed=2)
    wide = torch.full((rows, vocab + 64), 7.0).to(torch.bfloat16)
    wide[:, :vocab] = logits.to(torch.bfloat16)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[:, ::97] = True
    wide[:, :vocab].masked_fill_(~allowed, float("-inf"))
    view = wide[:, :vocab]
    got = ts.sample(*_on_device(view, temps, seeds, positions)).cpu()
    assert allowed.gather(1, got[:, None]).all()
    assert got.tolist() == _torch_draw(view, temps, seeds, positions).tolist()


def test_kernel_frequencies_follow_the_distribution():
    """Many positions of one row: each token's share of the draws matches its probability."""
    draws, vocab = 1200, 6  # each row is one interpreted program: ~20 ms each on CPU
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0]))
    got = ts.sample(
        *_on_device(
            logits.expand(draws, vocab).contiguous(),
            torch.ones(draws),
            torch.full((draws,), 1234, dtype=torch.int64),
            torch.arange(draws),
        )
    ).cpu()
    share = torch.bincount(got, minlength=vocab).float() / draws
    torch.testing.assert_close(share, logits.exp(), atol=0.045, rtol=0)  # 3 sigma at p=0.4
    assert share[-1] == 0  # probability 0 is never drawn


def test_sampler_dispatches_plain_rows_to_the_kernel(monkeypatch):
    """With the fused kernels forced on, `sample` takes the Triton kernel for rows without
    top-k / top-p / min-p, and draws what the torch formula draws."""
    monkeypatch.setenv(gpu.ENABLE_ENV, "1")
    gpu.reset()
    calls = []
    real = ts.sample
    monkeypatch.setattr(ts, "sample", lambda *a: calls.append(1) or real(*a))
    try:
        logits, temps, seeds, positions = _inputs(6, 3000, seed=3)
        params = [SamplingParams(temperature=float(t), max_tokens=4) for t in temps]
        sb = SamplingBatch.build(
            params, seeds.tolist(), positions.tolist(), 3000, ComputeStream(DEVICE)
        )
        got = sampler.Sampler(DEVICE).sample(logits.to(DEVICE), sb).token_ids.cpu()
    finally:
        gpu.reset()
    assert calls, "the Triton kernel was not used"
    assert got.tolist() == _torch_draw(logits, temps, seeds, positions).tolist()
