"""The fused Triton MoE kernel against the torch path, on random inputs.

Without a GPU the kernels run on CPU under Triton's interpreter: tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton. With a GPU they compile for CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (Linux: pip install triton)")
if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from minisgl.kernels.triton_moe import align_pairs_by_expert, fused_moe  # noqa: E402
from minisgl.layers.moe import moe_torch  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
FP32_ATOL = 1e-4
BF16_ATOL = 3e-2
# (tokens, experts, top_k, hidden, expert intermediate): decode, ragged K and N tiles, top-3,
# and a batch large enough for the 64-row blocks.
SHAPES = [(1, 8, 2, 64, 32), (37, 8, 2, 80, 48), (5, 4, 3, 64, 96), (300, 8, 2, 64, 32)]


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, experts // 2] = float("-inf")  # one expert gets no tokens at all
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_moe_matches_torch_fp32(shape) -> None:
    x, gate_up, down, weights, ids = _inputs(*shape)
    got = fused_moe(x, gate_up, down, weights, ids)
    want = moe_torch(x, gate_up, down, weights, ids)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


@pytest.mark.skipif(not ON_CUDA, reason="bf16 tiles need a GPU (the interpreter runs numpy)")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_moe_matches_torch_bf16(shape) -> None:
    x, gate_up, down, weights, ids = _inputs(*shape)
    x, gate_up, down = (t.to(torch.bfloat16) for t in (x, gate_up, down))
    got = fused_moe(x, gate_up, down, weights, ids).float()
    want = moe_torch(x.float(), gate_up.float(), down.float(), weights, ids)
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_every_pair_once_by_expert(block_m: int) -> None:
    *_, ids = _inputs(tokens=45, experts=8, top_k=2, hidden=16, inter=16, seed=3)
    num_pairs, num_experts = ids.numel(), 8
    sorted_ids, block_experts = align_pairs_by_expert(ids, num_experts, block_m)
    assert sorted_ids.numel() == block_experts.numel() * block_m
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    flat = ids.flatten().cpu()
    rows = sorted_ids.view(-1, block_m).cpu()
    for block, expert in zip(rows, block_experts.cpu().tolist(), strict=True):
        pairs = block[block < num_pairs]
        if expert == num_experts:  # past the end: nothing but padding
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and bool((flat[pairs] == expert).all())
    assert block_experts.tolist() == sorted(block_experts.tolist())  # runs in expert order
