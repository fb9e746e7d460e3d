"""GGUF weights served as their blocks on CPU (minisgl/kernels/csrc/quant.c, kernels/weights.py).

The `gguf` package is the oracle: its dequantization, then an fp32 matmul. Every served block
type against it with random blocks, at the row lengths the models here use and at batch sizes
of every kernel path (rows decoded in registers up to 20 rows, panels beyond; and the opt-in
int8 path, MINISGL_INT8_ACTIVATIONS: Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K with AVX2 or AVX-512
VNNI, times activations quantized to int8 as llama.cpp does (per 256 elements for the
K-quants, its quantize_row_q8_K redone in numpy; per 32 for the others, by hand and by gguf's
Q8_0); then whole models: a tiny GGUF Llama mixing every type (and one the kernels do not serve)
as blocks vs dequantized, tp 2 vs tp 1, and the bundled SmolLM2 Q4_1 as blocks vs the fp32
dequantized model (tokens equal; with int8 activations, the same log-likelihood of our docs);
and a tiny random Qwen3 in llama.cpp's Q4_K_M and Q8_0 layouts (K-quants written by quantize_k
here; the files llama.cpp's own converter and quantizer write where MINISGL_LLAMA_CPP names a
build) against transformers on the dequantized weights: greedy tokens up to the first near-tie.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from minisgl.config import ServerArgs
from minisgl.core import SamplingParams
from minisgl.kernels import cpu
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.weights import PackedLinear, QuantTensor
from minisgl.llm import LLM
from minisgl.models.default_model import (
    GGUF_FILE,
    GGUF_FILE_NAME,
    default_model_path,
    write_gguf_index,
)
from minisgl.models.loader import gguf_blocks
from minisgl.models.resolve import resolve_model_path
from minisgl.pooling import Pooling
from tests.conftest import QWEN3_VOCAB, qwen3_tokenizer_dir

T = GGMLQuantizationType
SERVED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K)
# a K-quant block; SmolLM2's hidden and intermediate sizes; 96: an odd number of blocks (no
# int8 path with AVX-512 VNNI, which takes blocks in pairs)
ROW_LENGTHS = (256, 576, 1536, 96)
BATCHES = (1, 3, 8, 16, 19, 40, 97)  # registers (<= 20; int8 <= 64), panels, > 1 chunk of x
# the int8 path's types (AVX2 or AVX-512 VNNI)
INT8_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K)
VNNI = " avx512_vnni" in Path("/proc/cpuinfo").read_text()
WEIGHT_STD = 0.15  # as the tiny HF checkpoints: logits far from uniform
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(200, 205)), list(range(300, 331)), [7, 8, 9, 10]]


def kernels():
    k = cpu.get()
    assert k is not None, "the CPU kernels must build here"
    return k


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: every bit random but the f16 scales (small and finite)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if block == 1:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8)
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    scales = {T.Q4_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q6_K: [208]}[qtype]
    for at in scales:
        raw[..., at : at + 2] = (
            rng.uniform(1e-3, 2e-2, raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(rows, -1)


def model_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of weights with mean 0 and std about WEIGHT_STD, for a model that answers."""
    weights = (rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(np.float32)
    return encode(weights, qtype)


def encode(weights: np.ndarray, qtype: T) -> np.ndarray:
    """fp32 weights [rows, cols] as blocks of `qtype` (uint8 [rows, row bytes]; F32 as is)."""
    if qtype in (T.Q4_K, T.Q6_K):
        return quantize_k(weights, qtype)
    return quantize(weights, qtype) if qtype != T.F32 else weights


def quantize_k(weights: np.ndarray, qtype: T) -> np.ndarray:
    """Q4_K or Q6_K blocks of fp32 weights [rows, cols] (cols a multiple of 256), each group's
    scale from its range (llama-quantize searches for better ones; gguf.quants quantizes neither
    type). What the tests need is gguf's dequantization of these blocks, the oracle."""
    rows = len(weights)
    x = np.asarray(weights, np.float32).reshape(-1, 256)
    n = len(x)

    def half(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # as stored, and as read back
        h = v.astype(np.float16)
        return h.view(np.uint8).reshape(n, 2), h.astype(np.float32)

    def codes(v: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
        return np.where(step > 0, np.round(v / np.where(step > 0, step, 1)), 0).clip(low, high)

    if qtype == T.Q4_K:  # w = d * scale * q - dmin * min: q 0..15, 6-bit scale and min per 32
        groups = x.reshape(n, 8, 32)
        low = np.minimum(groups.min(-1), 0)
        scale, minimum = (groups.max(-1) - low) / 15, -low
        (d, d32), (dmin, dmin32) = half(scale.max(-1) / 63), half(minimum.max(-1) / 63)
        sc = codes(scale, d32[:, None], 0, 63).astype(np.uint8)
        mn = codes(minimum, dmin32[:, None], 0, 63).astype(np.uint8)
        offset, step = (dmin32[:, None] * mn)[..., None], (d32[:, None] * sc)[..., None]
        q = codes(groups + offset, step, 0, 15).astype(np.uint8)
        # 12 bytes: scales and mins 0-3 in 6 bits, 4-7 split into a nibble and 2 top bits
        packed = [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4,
        ]
        nibbles = (q[:, 0::2] | q[:, 1::2] << 4).reshape(n, 128)  # groups 2i, 2i + 1 share bytes
        parts = [d, dmin, *packed, nibbles]
    else:  # Q6_K: w = d * scale * (q - 32): q 0..63, an int8 scale per 16
        groups = x.reshape(n, 16, 16)
        scale = np.abs(groups).max(-1) / 31
        d, d32 = half(scale.max(-1) / 127)
        sc = codes(scale, d32[:, None], 0, 127).astype(np.int8)
        q = (codes(groups, (d32[:, None] * sc)[..., None], -32, 31) + 32).astype(np.uint8)
        quarters = q.reshape(n, 2, 4, 32)  # per 128: element 32 j + l is quarter j's l
        low, high = quarters & 15, quarters >> 4
        ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], 2)
        qh = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path quantizes it, per 32 elements: codes round(x / d) (ties to even), d =
    max |x| / 127 in fp32; returned as codes times d."""
    blocks = x.reshape(len(x), -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def q8_k_activations(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_K rounds it, per 256 elements: iscale = -127 / the
    element of largest |x|, codes min(127, round(iscale * x)) (ties to even, its nearest_int),
    d = 1 / iscale, all in fp32; returned as codes times d."""
    blocks = x.numpy().reshape(len(x), -1, 256)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    with np.errstate(divide="ignore"):
        iscale = np.where(top == 0, 0, np.float32(-127) / top).astype(np.float32)
        d = np.where(iscale == 0, 0, np.float32(1) / iscale).astype(np.float32)
    codes = np.minimum(127, np.round(iscale * blocks))
    return torch.from_numpy((codes * d).astype(np.float32).reshape(x.shape))


@contextlib.contextmanager
def int8_activations_on(k: CpuKernels) -> Iterator[bool]:
    """The kernels' int8 path on (MINISGL_INT8_ACTIVATIONS=1) for a while; whether it could be
    (AVX2)."""
    try:
        yield k.set_int8_activations(True)
    finally:
        k.set_int8_activations(False)


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_block_kernels_match_gguf_dequantize(qtype: T) -> None:
    """GEMV, GEMM and embedding rows of random blocks against gguf's dequantization; with int8
    activations (Q4_0, Q4_1, Q8_0), against the same with x quantized by hand and by gguf."""
    k, rng = kernels(), np.random.default_rng(int(qtype))
    assert k.serves_blocks(int(qtype))
    for cols in ROW_LENGTHS:
        if cols % GGML_QUANT_SIZES[qtype][0]:
            continue  # a K-quant never holds rows of other lengths
        rows = 45  # not a multiple of the panel width or the register tiles
        weight = QuantTensor(
            int(qtype), torch.from_numpy(random_blocks(qtype, rows, cols, rng)), cols
        )
        want_weight = weight.dequantize()
        packed = PackedLinear.of_blocks({0: weight})
        assert torch.equal(k.embed(packed, torch.tensor([44, 0, 7])), want_weight[[44, 0, 7]])
        bias = torch.randn(rows)
        for batch in BATCHES:
            x = torch.randn(batch, cols)
            want = (x.double() @ want_weight.double().T + bias).float()
            tol = 1e-5 * float(want.abs().max())
            torch.testing.assert_close(k.linear(x, packed, bias), want, atol=tol, rtol=1e-5)
            if qtype not in INT8_TYPES or cols % (64 if VNNI else 32):
                continue
            with int8_activations_on(k) as on:
                got = k.linear(x, packed, bias) if on else None
            if got is None:
                continue  # no AVX2 here
            if qtype in (T.Q4_K, T.Q6_K):
                want = (q8_k_activations(x).double() @ want_weight.double().T + bias).float()
                torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)
                continue
            # gguf's Q8_0 keeps the scale in fp16 (the kernel, in fp32): close, not equal
            as_q8 = torch.from_numpy(dequantize(quantize(x.numpy(), T.Q8_0), T.Q8_0))
            want = as_q8 @ want_weight.T + bias
            torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)
            want = (int8_activations(x).double() @ want_weight.double().T + bias).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_block_kernels_do_not_depend_on_the_batch_or_threads(qtype: T) -> None:
    """Up to 20 rows (decoding, and a verify step's drafts) a row's output is bitwise the same
    whatever its batch mates and the thread count: rows in passes of 8, K in slices from 7 rows
    at 1536 and 3 at 4096, yet each row adds in one order (a draft row's logits are plain
    decoding's); so with int8 activations (AVX2: passes of 4 rows)."""
    k, rng = kernels(), np.random.default_rng(100 + int(qtype))
    for cols, int8 in [(c, False) for c in (256, 1536, 4096)] + [(1536, qtype in INT8_TYPES)]:
        blocks = torch.from_numpy(random_blocks(qtype, 45, cols, rng))  # a short last item
        packed = PackedLinear.of_blocks({0: QuantTensor(int(qtype), blocks, cols)})
        x = torch.randn(20, cols)
        previous = torch.get_num_threads()
        with int8_activations_on(k) if int8 else contextlib.nullcontext():
            alone = torch.cat([k.linear(x[i : i + 1], packed) for i in range(len(x))])
            try:
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for rows in range(2, 21):
                        got = k.linear(x[:rows], packed)
                        assert torch.equal(got, alone[:rows]), (cols, rows, int8)
            finally:
                torch.set_num_threads(previous)


def test_merged_segments_and_tensor_parallel_cuts() -> None:
    """A merged weight of three types (Q4_K_M files give q and k Q4_K, v Q6_K), column cuts on
    and inside block boundaries, and fp32 rows of a length that is no multiple of 32."""
    k, rng = kernels(), np.random.default_rng(0)
    parts = [
        QuantTensor(int(t), torch.from_numpy(random_blocks(t, rows, 512, rng)), 512)
        for t, rows in ((T.Q4_K, 41), (T.Q4_K, 8), (T.Q6_K, 7))  # seams inside 16-row items
    ]
    parts.append(QuantTensor.of_float(torch.randn(5, 512)))
    want_weight = torch.cat([p.dequantize() for p in parts])
    packed = PackedLinear.of_blocks(dict(enumerate(parts)))
    assert packed.out_features == 61 and len(packed.segments) == 4
    for batch in (1, 5, 16, 40):
        x = torch.randn(batch, 512)
        want = x @ want_weight.T
        torch.testing.assert_close(
            k.linear(x, packed), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5
        )
    on_blocks, inside = parts[0].narrow(1, 256, 256), parts[0].narrow(1, 128, 256)
    assert on_blocks.qtype == T.Q4_K and inside.qtype == T.F32  # a cut inside: fp32 rows
    for cut, start in ((on_blocks, 256), (inside, 128)):
        assert torch.equal(cut.dequantize(), parts[0].dequantize()[:, start : start + 256])
    odd = QuantTensor.of_float(torch.randn(9, 37))
    x = torch.randn(20, 37)
    torch.testing.assert_close(
        k.linear(x, PackedLinear.of_blocks({0: odd})), x @ odd.dequantize().T
    )


LAYER_TYPES = [  # every served type, a merged qkv of two types, one type served dequantized
    {
        "attn_q": T.Q4_K,
        "attn_k": T.Q4_K,
        "attn_v": T.Q6_K,
        "attn_output": T.Q4_K,
        "ffn_gate": T.Q4_1,
        "ffn_up": T.Q8_0,
        "ffn_down": T.Q6_K,
    },
    {
        "attn_q": T.Q8_0,
        "attn_k": T.F16,
        "attn_v": T.BF16,
        "attn_output": T.Q5_0,
        "ffn_gate": T.F32,
        "ffn_up": T.Q4_0,
        "ffn_down": T.Q4_K,
    },
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 256: K-quant rows) as an HF folder whose weights are a GGUF."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("gguf") / "tiny"
    config = LlamaConfig(
        vocab_size=QWEN3_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=151645,
        bos_token_id=151643,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(root)
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, root / f.name)
    rng = np.random.default_rng(0)
    writer = GGUFWriter(root / GGUF_FILE, "llama")
    shapes = {
        "attn_q": (256, 256),
        "attn_k": (128, 256),
        "attn_v": (128, 256),
        "attn_output": (256, 256),
        "ffn_gate": (512, 256),
        "ffn_up": (512, 256),
        "ffn_down": (256, 512),
    }
    for layer, types in enumerate(LAYER_TYPES):
        for name, qtype in types.items():
            blocks = model_blocks(qtype, *shapes[name], rng)
            writer.add_tensor(f"blk.{layer}.{name}.weight", blocks, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(256, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.add_tensor(
        "token_embd.weight", model_blocks(T.Q8_0, QWEN3_VOCAB, 256, rng), raw_dtype=T.Q8_0
    )
    writer.add_tensor(
        "output.weight", model_blocks(T.Q6_K, QWEN3_VOCAB, 256, rng), raw_dtype=T.Q6_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_gguf_index(root / GGUF_FILE, root)
    return root


def _tokens(model: Path, caplog=None, **options) -> list[list[int]]:
    with LLM(str(model), num_pages=1024, max_running_requests=4, **options) as llm:
        engine = llm.scheduler.engine  # type: ignore[attr-defined]
        qkv = engine.model.model.layers[0].self_attn.qkv_proj
        assert bool(qkv.packed.segments) == (options.get("quantization") != "none")
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_tiny_gguf_blocks_match_dequantized_and_tp2(tiny_gguf: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.models.loader"):
        blocks = _tokens(tiny_gguf)
    assert "GGUF Q5_0 weights are dequantized to fp32 at load" in caplog.text
    assert blocks == _tokens(tiny_gguf, quantization="none")
    assert blocks == _tokens(tiny_gguf, tp_size=2, max_prefill_tokens=16)


SMOL_CHATS = ["What is the capital of France?", "Write a haiku about the sea."]


def test_bundled_model_as_blocks_matches_fp32(tmp_path: Path) -> None:
    """SmolLM2 Q4_1 as blocks: its greedy tokens are the fp32 dequantized model's; both are
    served from the GGUF file (--model file.gguf is the same folder as the default)."""
    bundled = resolve_model_path(None).joinpath(GGUF_FILE).resolve()
    assert bundled.name == GGUF_FILE_NAME
    assert resolve_model_path(str(bundled)) == resolve_model_path(None)
    messages = [[{"role": "user", "content": chat}] for chat in SMOL_CHATS]
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = {}
    for quantization in ("auto", "none"):
        with LLM(None, quantization=quantization, num_pages=1024) as llm:
            down = llm.scheduler.engine.model.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
            assert down.packed.segments == (((int(T.Q4_1), 576),) if quantization == "auto" else ())
            outputs[quantization] = [out.token_ids for out in llm.chat(messages, params)]
    assert outputs["auto"] == outputs["none"]


def test_bundled_model_with_int8_activations_scores_as_fp32() -> None:
    """MINISGL_INT8_ACTIVATIONS=1: the bundled model (Q4_1 layers, a Q8_0 head) scoring this
    repository's docs has the fp32 model's mean log-likelihood within 1%; each token's logprob
    moves ~0.07 on average (enough to swap near-tied greedy choices, not the model's quality)."""
    with int8_activations_on(kernels()) as on:
        if not on:
            pytest.skip("no AVX2 on this CPU: the int8 path cannot run")
    root = Path(__file__).resolve().parents[1]
    texts = (root / "docs" / "architecture.md").read_text().split("\n\n")
    texts = [p for p in texts if 400 < len(p) < 2000][:3]
    logprobs = {}
    for int8 in (True, False):
        switch = int8_activations_on(kernels()) if int8 else contextlib.nullcontext()
        with switch, LLM(None, num_pages=1024) as llm:
            scored = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0))
        logprobs[int8] = np.array([p.logprob for out in scored for p in out.prompt_logprobs if p])
    int8, fp32 = logprobs[True], logprobs[False]
    assert len(int8) == len(fp32) > 500
    assert abs(int8.mean() - fp32.mean()) < 0.01 * abs(fp32.mean())
    assert 0 < np.abs(int8 - fp32).mean() < 0.15


def test_quantization_rules(tmp_path: Path, tiny_models, caplog) -> None:
    """--quantization gguf needs a GGUF model and the fp32 CPU kernels; auto dequantizes (with a
    log line) where blocks are not served; none always dequantizes."""
    k, gguf_dir = kernels(), default_model_path()
    where = "torch.bfloat16 on cpu"
    args = ServerArgs(quantization="gguf")
    with pytest.raises(
        ValueError, match=r"--quantization gguf needs a GGUF model \(--model x.gguf\)"
    ):
        gguf_blocks(args, tiny_models["llama"], k, where)
    with pytest.raises(
        ValueError, match=rf"--quantization gguf needs the fp32 CPU kernels \(not {where}\)"
    ):
        gguf_blocks(args, gguf_dir, None, where)
    assert gguf_blocks(args, gguf_dir, k, where) is k
    assert gguf_blocks(ServerArgs(), gguf_dir, k, where) is k
    assert gguf_blocks(ServerArgs(quantization="none"), gguf_dir, k, where) is None
    with caplog.at_level(logging.INFO, logger="minisgl.models.loader"):
        assert gguf_blocks(ServerArgs(dtype="float32"), gguf_dir, k, where) is None
        assert gguf_blocks(ServerArgs(), gguf_dir, None, where) is None
    assert f"GGUF weights dequantized to {where}" in caplog.text
    with pytest.raises(ValueError, match="quantization: must be one of auto, gguf, none"):
        ServerArgs(quantization="fp8")


# ---- Qwen3 as llama.cpp's files: Q4_K_M and Q8_0 -------------------------------------------------
# every matrix's row length a multiple of 256 (K-quants); head_dim 128 as every Qwen3's (and
# what transformers' GGUF loader assumes: it does not read the file's key length)
QWEN3_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    tie_word_embeddings=True,
)
# greedy tokens must agree up to the reference's first near-tie: where its top two are this close
# (nats), fp32 summation order may pick either
NEAR_TIE = 0.15
QWEN3_GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# the final norm's weights: logits spread wide enough that near-ties are rare (with 1, as
# Qwen3's initialisation, about one greedy token in four follows one)
LOGIT_GAIN = 10.0
LLAMA_CPP_ENV = "MINISGL_LLAMA_CPP"  # a llama.cpp source tree with build/bin/llama-quantize


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M makes Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama_quantize_type(ftype: str, gguf_name: str, layers: int) -> T:
    """The type llama-quantize gives a Qwen3 matrix for a file type (Q8_0: every matrix; Q4_K_M:
    Q4_K, Q6_K for the tied embedding and for attn_v / ffn_down in the layers above)."""
    if ftype == "Q8_0":
        return T.Q8_0
    if gguf_name == "token_embd.weight":
        return T.Q6_K
    part = gguf_name.split(".")
    if part[2] in ("attn_v", "ffn_down") and more_bits(int(part[1]), layers):
        return T.Q6_K
    return T.Q4_K


def tiny_qwen3(path: Path | None = None):
    """A random tiny Qwen3 (weights std WEIGHT_STD, the final norm's LOGIT_GAIN), saved with the
    Qwen3 tokenizer if `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        max_position_embeddings=1024,
        eos_token_id=151645,
        bos_token_id=151643,
        **QWEN3_SHAPE,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, WEIGHT_STD)
        model.model.norm.weight.fill_(LOGIT_GAIN)
    if path is not None:
        model.save_pretrained(path)
        for f in qwen3_tokenizer_dir().iterdir():
            shutil.copy(f, path / f.name)
    return model


@pytest.fixture(scope="module", params=["Q4_K_M", "Q8_0"])
def qwen3_gguf(request, tmp_path_factory):
    """(an HF folder whose weights are a GGUF file laid out as llama-quantize lays out the file
    type, the same model in transformers with those blocks dequantized: the reference)."""
    import gguf

    root = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    model = tiny_qwen3()
    layers = model.config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)
    writer = GGUFWriter(root / GGUF_FILE, "qwen3")
    writer.add_pooling_type(gguf.PoolingType.LAST)  # as a Qwen3-Embedding file declares it
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied head is the embedding
            gguf_name = names.get_name(name, (".weight",))
            if p.dim() == 1:
                writer.add_tensor(gguf_name, p.numpy().copy())
                continue
            qtype = llama_quantize_type(request.param, gguf_name, layers)
            blocks = encode(p.numpy(), qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            p.copy_(torch.from_numpy(dequantize(blocks, qtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_gguf_index(root / GGUF_FILE, root)
    model.config.save_pretrained(root)
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, root / f.name)
    return root, model, request.param


def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], int]:
    """The reference's greedy tokens, and how many of them come before its first near-tie."""
    ids, tokens, gaps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(steps):
            top = model(ids).logits[0, -1].double().log_softmax(-1).topk(2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return tokens, next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), steps)


def assert_greedy_matches(outputs: list[list[int]], reference) -> None:
    agreed = 0
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        want, until = reference_greedy(reference, prompt, len(got))
        assert got[:until] == want[:until], (prompt, got, want, until)
        agreed += until
    assert agreed >= 20  # of 36 (Q4_K_M 24: one prompt's first token is a near-tie; Q8_0 36)


def test_qwen3_q4_k_m_and_q8_0_match_transformers(qwen3_gguf) -> None:
    """A tiny Qwen3 in llama.cpp's Q4_K_M and Q8_0 layouts, served as blocks (each type where
    llama-quantize puts it): greedy tokens equal transformers' on the dequantized weights up to
    its first near-tie, three prompts at once and each alone."""
    folder, reference, ftype = qwen3_gguf
    with LLM(str(folder), num_pages=1024, max_running_requests=4) as llm:
        layers = llm.scheduler.engine.model.model.layers  # type: ignore[attr-defined]
        for i, layer in enumerate(layers):
            got = [T(qtype) for qtype, _ in layer.self_attn.qkv_proj.packed.segments]
            names = [f"blk.{i}.attn_{part}.weight" for part in "qkv"]
            assert got == [llama_quantize_type(ftype, n, len(layers)) for n in names]
        batched = [out.token_ids for out in llm.generate(PROMPTS, QWEN3_GREEDY)]
        alone = [llm.generate([p], QWEN3_GREEDY)[0].token_ids for p in PROMPTS]
    assert_greedy_matches(batched, reference)
    assert_greedy_matches(alone, reference)


def test_qwen3_with_int8_activations_matches_transformers_on_rounded_inputs(qwen3_gguf) -> None:
    """MINISGL_INT8_ACTIVATIONS=1: the tiny Qwen3's greedy tokens equal transformers' on the
    dequantized weights with every projection's input (the head's too) rounded as llama.cpp
    quantizes it for the weights' type (q8_K for Q4_K_M's K-quants), up to its first
    near-tie."""
    folder, reference, ftype = qwen3_gguf
    if ftype != "Q4_K_M":
        pytest.skip("Q8_0 times int8 activations: test_block_kernels_match_gguf_dequantize")
    with int8_activations_on(kernels()) as on:
        if not on:
            pytest.skip("no AVX2 on this CPU: the int8 path cannot run")
        with LLM(str(folder), num_pages=1024, max_running_requests=4) as llm:
            outputs = [out.token_ids for out in llm.generate(PROMPTS, QWEN3_GREEDY)]
    rounded = q8_k_activations
    hooks = [
        m.register_forward_pre_hook(lambda _, args: rounded(args[0][0]).unsqueeze(0))
        for m in reference.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        assert_greedy_matches(outputs, reference)
    finally:
        for hook in hooks:
            hook.remove()


def test_gguf_pooling_type_embeds_as_declared(qwen3_gguf) -> None:
    """The file's `qwen3.pooling_type` (last) reaches the server's pooling: each vector is the
    last token's final hidden state, L2-normalised, of transformers on the dequantized weights."""
    folder, reference, _ = qwen3_gguf
    with LLM(str(folder), num_pages=1024, max_running_requests=4) as llm:
        assert llm.pooling == Pooling("last", True)
        got = torch.tensor(llm.embed(PROMPTS))
    with torch.no_grad():
        states = [reference.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS]
    want = torch.nn.functional.normalize(torch.stack(states), dim=1)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.99999


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_llama_cpp_files_match_transformers(ftype: str, tmp_path: Path) -> None:
    """The tiny Qwen3 as llama.cpp's own convert_hf_to_gguf.py and llama-quantize write it (where
    MINISGL_LLAMA_CPP names a built llama.cpp source tree: CI has none, and skips), served with
    --model FILE: greedy tokens equal transformers' on the file's dequantized weights (its GGUF
    loader) up to the first near-tie."""
    source = Path(os.environ.get(LLAMA_CPP_ENV, "/nonexistent"))
    quantizer = source / "build" / "bin" / "llama-quantize"
    if not quantizer.exists() or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip(f"needs {LLAMA_CPP_ENV} (llama.cpp built there) and sentencepiece")
    tiny_qwen3(tmp_path)
    out, f16 = tmp_path / f"tiny-{ftype}.gguf", tmp_path / "tiny-f16.gguf"
    pythonpath = [str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    convert = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(tmp_path), "--outfile"]
    if ftype == "Q8_0":
        subprocess.run([*convert, str(out), "--outtype", "q8_0"], check=True, env=env)
    else:
        subprocess.run([*convert, str(f16), "--outtype", "f16"], check=True, env=env)
        subprocess.run([str(quantizer), str(f16), str(out), ftype], check=True)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=out.name, dtype=torch.float32
    ).eval()
    with LLM(str(out), num_pages=1024, max_running_requests=4) as llm:
        outputs = [out.token_ids for out in llm.generate(PROMPTS, QWEN3_GREEDY)]
    assert_greedy_matches(outputs, reference)
