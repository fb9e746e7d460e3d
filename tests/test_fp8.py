"""FP8: checkpoints (dequantized at load) and the fp8 KV cache (--kv-cache-dtype).

Checkpoints: a tiny random model whose linear weights this test quantizes to float8_e4m3fn with
its own scale math (128x128 blocks, one scale per tensor, one per output row), the scales in a
second shard; the oracle is transformers running the same fp8 weights dequantized here to fp32.

KV cache: the bundled SmolLM2 on a real-text prompt, fp8 KV against fp32 KV: the prompt's
logprobs (prefill) and a greedy continuation (the fused C decode stack), with the error
bounded; the pool holds 4x the tokens in the same memory.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.attention import AttentionConfig
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.kvcache.pool import KVPool
from tests.conftest import build_tiny_checkpoint
from tests.test_model_parity import _prompts, check_against_hf
from tests.test_triton_attention import DEVICE, MAX_SEQ_LEN, Scenario, _build, _run, requires_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
LINEAR_RE = re.compile(r"_proj\.weight$")  # q/k/v/o, gate/up/down, every expert's
KV_SCALES = (1 / 32, 1 / 16)  # written into the block checkpoint as its k_scale / v_scale


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its scale as the checkpoint stores it, the fp32 weight they stand for)."""
    if scheme == "block":  # pad to whole 128x128 tiles, one scale per tile
        rows, cols = w.shape
        padded = F.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
        tiles = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
        scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX  # [row tiles, column tiles]
        q = (tiles / scale[:, None, :, None]).to(FP8)
        dequantized = (q.float() * scale[:, None, :, None]).view(padded.shape)[:rows, :cols]
        return q.view(padded.shape)[:rows, :cols].contiguous(), scale, dequantized.contiguous()
    if scheme == "tensor":
        scale = w.abs().max().reshape(1) / FP8_MAX
    else:  # per output row, [rows, 1] as compressed-tensors stores it
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    q = (w / scale).to(FP8)
    return q, scale, q.float() * scale


def _fp8_checkpoint(src: Path, root: Path, scheme: str) -> tuple[Path, Path]:
    """(the fp8 checkpoint, the oracle's fp32 one) made from `src`."""
    fp8_dir, ref_dir = root / "fp8", root / "ref"
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    tensors = load_file(src / "model.safetensors")
    weights, scales, dequantized = {}, {}, dict(tensors)
    for name, w in tensors.items():
        if LINEAR_RE.search(name):
            q, scale, dequantized[name] = _quantize(w, scheme)
            weights[name] = q
            suffix = "weight_scale_inv" if scheme == "block" else "weight_scale"
            scales[name.removesuffix("weight") + suffix] = scale
        else:
            weights[name] = w
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        quant["weight_block_size"] = [BLOCK, BLOCK]
        for layer in range(config["num_hidden_layers"]):
            for kind, value in zip("kv", KV_SCALES, strict=True):
                scales[f"model.layers.{layer}.self_attn.{kind}_scale"] = torch.tensor(value)
    (fp8_dir / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": weights,
        "model-00002-of-00002.safetensors": scales,
    }
    for shard, part in shards.items():
        save_file(part, fp8_dir / shard)
    index = {"weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(dequantized, ref_dir / "model.safetensors")
    return fp8_dir, ref_dir


# 192 / 320 wide: whole and partial 128x128 blocks; Qwen3-MoE: every expert's pieces too
CHECKPOINTS = {
    "block": ("qwen3", {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 6}),
    "tensor": ("llama", {}),
    "channel": ("qwen3_moe", {}),
}


@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_fp8_checkpoint_matches_hf_on_the_dequantized_weights(tmp_path, scheme, caplog):
    arch, overrides = CHECKPOINTS[scheme]
    src = build_tiny_checkpoint(tmp_path / "src", arch, vocab_size=8192, **overrides)
    fp8_dir, ref_dir = _fp8_checkpoint(src, tmp_path, scheme)
    with caplog.at_level(logging.INFO, logger="minisgl.models.loader"):
        llm = LLM(str(fp8_dir), dtype="float32", num_pages=512, page_size=4)
    with llm:
        assert "FP8 checkpoint: " in caplog.text
        check_against_hf(ref_dir, llm, _prompts()[:3], 8)
    if scheme == "block":  # its k_scale / v_scale go to an fp8 KV pool
        with LLM(str(fp8_dir), dtype="float32", num_pages=512, kv_cache_dtype="fp8_e4m3") as llm:
            scales = llm.scheduler.engine.kv_pool.scales  # type: ignore[attr-defined]
            assert scales.tolist() == [list(KV_SCALES)] * scales.shape[0]
            llm.generate(_prompts()[:2], SamplingParams(temperature=0, max_tokens=4))
            llm.check_page_accounting()


def test_other_quantization_methods_fail_at_start(tmp_path, tiny_models):
    model = tmp_path / "awq"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="quant_method 'awq' is not supported"):
        LLM(str(model), dtype="float32", num_pages=64)


# ---- the fp8 KV cache ----------------------------------------------------------------------------

TEXT = (
    "The river rises in the hills to the north and flows for some two hundred miles before it "
    "reaches the sea. For most of its length it runs through farmland, and the towns along its "
    "banks grew up as markets where farmers sold grain, wool and cattle. In the nineteenth "
    "century a canal was cut to join it to the industrial cities of the midlands, and for a few "
    "decades barges carried coal and iron down to the port. The railways soon took most of that "
    "trade away, and today the river is used mainly by anglers, rowers and holiday boats."
)
NEW_TOKENS = 16
KV_GB = 0.05
# |logprob(fp8 KV) - logprob(fp32 KV)| over the prompt's 113 tokens, mean and max (measured:
# e4m3 0.071 / 0.67, e5m2 0.145 / 0.83; docs/models.md), and the greedy tokens that must agree
BOUNDS = {"fp8_e4m3": (0.12, 1.2, NEW_TOKENS), "fp8_e5m2": (0.25, 1.5, 4)}


def _score(kv_cache_dtype: str):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, prompt_logprobs=0, logprobs=0)
    with LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_gb=KV_GB) as llm:
        out = llm.generate([TEXT], params)[0]
        llm.check_page_accounting()
        pool = llm.scheduler.engine.kv_pool  # type: ignore[attr-defined]
        return out, pool.num_slots, pool.buffer.dtype


@pytest.fixture(scope="module")
def full_precision():
    return _score("auto")


@pytest.mark.parametrize("kv_cache_dtype", list(BOUNDS))
def test_fp8_kv_cache_error_on_real_text(full_precision, kv_cache_dtype):
    ref, ref_slots, ref_dtype = full_precision
    out, slots, dtype = _score(kv_cache_dtype)
    assert ref_dtype == torch.float32 and dtype.itemsize == 1
    assert slots == pytest.approx(4 * ref_slots, abs=4)  # the same 0.05 GiB holds 4x the tokens
    diff = torch.tensor(
        [
            a.logprob - b.logprob
            for a, b in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True)
        ]
    ).abs()
    mean_bound, max_bound, num_equal = BOUNDS[kv_cache_dtype]
    print(f"{kv_cache_dtype}: {diff.numel()} prompt logprobs, |diff| mean {diff.mean():.4f} "
          f"max {diff.max():.4f}; greedy {out.token_ids} vs {ref.token_ids}")  # fmt: skip
    assert diff.mean() < mean_bound and diff.max() < max_bound
    assert out.token_ids[:num_equal] == ref.token_ids[:num_equal]


@requires_triton
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_attention_reads_an_fp8_pool(kv_dtype):
    """Triton's decode and extend kernels over an fp8 pool (scales not 1) equal torch-native's
    attention over the same pool."""
    from minisgl.attention.triton_backend import TritonBackend

    s = Scenario([(0, 9), (20, 1), (70, 3), (5, 1)])
    pool32, batch, q, k, v = _build(s)
    pool = KVPool(
        pool32.shape, pool32.num_pages, s.page_size, kv_dtype, DEVICE, torch.tensor([[0.5, 2.0]])
    )
    pool.buffer.copy_(pool32.buffer)
    before = pool.buffer.clone()
    cfg = AttentionConfig(
        s.num_heads, s.num_kv_heads, s.head_dim, s.page_size, MAX_SEQ_LEN, s.dtype, DEVICE, kv_dtype
    )
    got = _run(TritonBackend(cfg), pool, batch, q, k, v)
    stored = pool.buffer.clone()
    pool.buffer.copy_(before)
    want = _run(TorchNativeBackend(), pool, batch, q, k, v)
    assert torch.equal(stored.view(torch.uint8), pool.buffer.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
