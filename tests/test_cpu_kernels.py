"""The fp32 CPU kernels (minisgl/kernels) against torch's own ops, and the engine with and
without them.

Each kernel is compared with the torch reference it replaces, on odd shapes (sizes that are not
multiples of the vector width or panel width, strided views, grouped heads, shuffled pages).
Whole models: the kernels' greedy tokens and logprobs equal the torch path's, and the fused
decode stack (one call per step) equals the op-by-op kernels.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.attention.base import AttentionBatch, AttentionConfig
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.kernels import build, cpu
from minisgl.kvcache.pool import KVPool, KVShape
from minisgl.layers.norm import RMSNorm, rms_norm
from minisgl.layers.rope import RopeConfig, RotaryEmbedding

REPO_ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # values of order 1: fp32 sums in another order
LOGPROB_ATOL = 1e-4

KERNELS = cpu.get()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the torch path serves")


def _kernels() -> cpu.CpuKernels:
    assert KERNELS is not None
    return KERNELS


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 576, 960), (3, 64, 33), (13, 37, 100), (100, 96, 250), (1, 1, 1)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, in_features, out_features, bias):
    k = _kernels()
    w = _randn(out_features, in_features, seed=1) / in_features**0.5
    b = _randn(out_features, seed=2) if bias else None
    x = _randn(rows, in_features, seed=3)
    got = k.linear(x, k.pack(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=ATOL, rtol=ATOL)
    # a strided view (every other row) and a leading batch dimension
    wide = _randn(2 * rows, in_features, seed=4)
    torch.testing.assert_close(k.linear(wide[::2], k.pack(w), b), F.linear(wide[::2], w, b))
    x3 = x.view(1, rows, in_features)
    assert k.linear(x3, k.pack(w), b).shape == (1, rows, out_features)


def test_linear_does_not_depend_on_thread_count_or_batch():
    """Each output element is one sum over k in a fixed order: bitwise equal whatever the
    threads or the other rows (a sequence's tokens do not depend on its batch mates)."""
    k = _kernels()
    w = k.pack(_randn(300, 128, seed=5))
    x = _randn(40, 128, seed=6)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.linear(x, w)
        torch.set_num_threads(2)
        two = k.linear(x, w)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
    for rows in range(1, 26):  # every register tile size, and rows split over tiles
        assert torch.equal(k.linear(x[5 : 5 + rows], w), one[5 : 5 + rows])


def test_rmsnorm_with_and_without_residual():
    k = _kernels()
    norm = RMSNorm(70, 1e-6)
    norm.weight.data = _randn(70, seed=7)
    x, residual = _randn(9, 70, seed=8), _randn(9, 70, seed=9)
    torch.testing.assert_close(k.rmsnorm(x, norm.weight, 1e-6), rms_norm(x, norm.weight, 1e-6))
    summed = x + residual
    got = k.rmsnorm(x, norm.weight, 1e-6, residual)
    torch.testing.assert_close(got, rms_norm(summed, norm.weight, 1e-6))
    assert torch.equal(residual, summed)  # the fused add wrote the sum back


def test_head_norm_in_place_on_a_strided_view():
    k = _kernels()
    qkv = _randn(5, 4 * 32 + 2 * 2 * 32, seed=10)
    q, key = qkv[:, : 4 * 32].view(5, 4, 32), qkv[:, 4 * 32 : 6 * 32].view(5, 2, 32)
    weight = _randn(32, seed=11)
    want_q, want_k = rms_norm(q, weight, 1e-6), rms_norm(key, weight, 1e-6)
    untouched = qkv[:, 6 * 32 :].clone()
    rope = RotaryEmbedding(32, 8, RopeConfig(10000.0))
    at_zero = torch.zeros(5, dtype=torch.int64)  # position 0 (cos 1, sin 0): the norm alone
    got = k.qk_norm_rope(q, key, at_zero, rope.cos_cache, rope.sin_cache, weight, weight, 1e-6)
    assert got[0] is q and got[1] is key
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(key, want_k)
    assert torch.equal(qkv[:, 6 * 32 :], untouched)


def test_silu_mul_matches_torch_over_the_whole_range():
    k = _kernels()
    gate = torch.cat([torch.linspace(-120, 120, 2001), _randn(99, seed=12) * 4]).view(4, -1)
    up = _randn(*gate.shape, seed=13)
    got = k.silu_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(got, F.silu(gate) * up, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 18])
def test_rope_in_place_matches_the_reference(head_dim):
    k = _kernels()
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(10000.0))
    qkv = _randn(6, (3 + 2) * head_dim, seed=14)
    q = qkv[:, : 3 * head_dim].view(6, 3, head_dim)
    key = qkv[:, 3 * head_dim : 4 * head_dim].view(6, 1, head_dim)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    want_q, want_k = q.clone(), key.clone()
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    half = head_dim // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    want_q, want_k = rotate(want_q), rotate(want_k)
    k.qk_norm_rope(q, key, positions, rope.cos_cache, rope.sin_cache, None, None, 0.0)
    torch.testing.assert_close(q, want_q, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(key, want_k, atol=ATOL, rtol=ATOL)


FP8_KV = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "kv_dtype"),
    [(9, 3, 64, torch.float32), (4, 4, 20, torch.float32), (16, 2, 128, torch.float32),
     (10, 2, 40, torch.float32), (9, 3, 64, FP8_KV[0]), (10, 2, 40, FP8_KV[1]),
     (16, 2, 128, torch.bfloat16), (4, 4, 20, torch.float16)],
)  # fmt: skip
def test_paged_decode_attention_matches_sdpa(
    page_size, num_heads, num_kv_heads, head_dim, kv_dtype
):
    """A mixed batch (decodes of very different KV lengths around prefill chunks, one after a
    cached prefix) over a shuffled pool: the kernels' decodes and chunks equal the SDPA
    reference's; over an fp8 pool (its per-layer K/V scales not 1) and a 16-bit one too, the
    reference converting in torch."""
    # (prefix_len, extend_len); 1100 spans nine of the decode kernel's 128-position work items,
    # 70 tokens several of the chunk kernel's blocks, and its 960-position segments: the first
    # tokens see nothing of the second segment, which the block's last ones see
    seqs = [(1100, 1), (5, 1), (0, 7), (129, 1), (0, 1), (950, 70)]
    g = torch.Generator().manual_seed(15)
    num_pages = sum(-(-(pre + ext) // page_size) for pre, ext in seqs) + 4
    scales = torch.tensor([[1.0, 1.0], [0.6, 1.7]])
    pool = KVPool(
        KVShape(2, num_kv_heads, head_dim), num_pages, page_size, kv_dtype, torch.device("cpu"),
        scales,
    )  # fmt: skip
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    width = max(-(-(pre + ext) // page_size) for pre, ext in seqs) * page_size
    page_table = torch.zeros(len(seqs) + 1, width, dtype=torch.int32)
    pages = torch.randperm(num_pages, generator=g).tolist()
    for row, (pre, ext) in enumerate(seqs):
        for p in range(-(-(pre + ext) // page_size)):
            page = pages.pop()
            page_table[row, p * page_size : (p + 1) * page_size] = torch.arange(
                page * page_size, (page + 1) * page_size
            )
    rows = torch.tensor([1, 0, 2, 3, 5, 4])  # not in order: rows and sequences are distinct
    page_table[rows] = page_table[: len(seqs)].clone()
    prefix = torch.tensor([pre for pre, _ in seqs])
    kv_lens = prefix + torch.tensor([ext for _, ext in seqs])
    token_rows = rows.repeat_interleave(kv_lens - prefix)
    positions = torch.cat([torch.arange(pre, pre + ext) for pre, ext in seqs])
    batch = AttentionBatch(
        table_rows=rows,
        prefix_lens=prefix,
        kv_lens=kv_lens,
        out_slots=page_table[token_rows, positions].long(),
        page_table=page_table,
        prefix_lens_cpu=prefix.tolist(),
        kv_lens_cpu=kv_lens.tolist(),
    )
    num_tokens = positions.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    cfg = AttentionConfig(
        num_heads, num_kv_heads, head_dim, page_size, width, torch.float32, torch.device("cpu")
    )
    backend, reference = TorchNativeBackend(cfg), TorchNativeBackend()  # the SDPA path for all
    kernel_meta = backend.prepare(batch)
    assert kernel_meta.kernel_decodes is not None and len(kernel_meta.kernel_chunks) == 2
    pool_before = pool.buffer.clone()
    got = backend.forward(q, k, v, 1, pool, kernel_meta)
    stored = pool.buffer.clone()
    pool.buffer.copy_(pool_before)
    want = reference.forward(q, k, v, 1, pool, reference.prepare(batch))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert torch.equal(stored, pool.buffer)  # the kernel stored the same K/V


KV_CODEC_C = """
#include "common.h"
void decode_all(int kv, const char* codes, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(out + i, kv_vload(codes + i * kv_bytes(kv), kv));
    for (; i < n; i++) out[i] = kv_get(codes, i, kv);
}
void encode_all(int kv, const float* x, int64_t n, char* out) {
    for (int64_t i = 0; i < n; i++) kv_encode(x[i], kv, out + i * kv_bytes(kv));
}
"""


@pytest.mark.parametrize("native", [True, False])
def test_kv_formats_decode_and_encode_as_torch_converts(tmp_path, native):
    """common.h's K/V codecs (what attention reads, what the fused stack stores) against torch's
    conversions: every finite code decodes to torch's value; values of every magnitude, every
    code and every midpoint between codes (ties) encode to torch's code of the clamped value.
    Built with and without -march=native (F16C's half conversion, then the portable bits)."""
    import ctypes
    import subprocess

    from minisgl.kernels.cpu_abi import KV_FORMATS

    (tmp_path / "codec.c").write_text(KV_CODEC_C)
    lib_path, csrc = tmp_path / "codec.so", Path(cpu.__file__).parent / "csrc"
    flags = build.FLAGS + (build.NATIVE_FLAGS if native else ())
    compiler = next(c for c in build.COMPILERS if shutil.which(c))
    cmd = [compiler, *flags, f"-I{csrc}", str(tmp_path / "codec.c"), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, timeout=60)
    lib, g = ctypes.CDLL(str(lib_path)), torch.Generator().manual_seed(0)
    for dtype, kv in KV_FORMATS.items():
        bits = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32)
        codes = bits.to(torch.uint8 if dtype.itemsize == 1 else torch.int16).view(dtype)
        finite = codes.float().isfinite()
        values = codes.float()[finite]
        got = torch.empty(len(bits))
        lib.decode_all(
            kv,
            ctypes.c_void_p(codes.data_ptr()),
            ctypes.c_int64(len(bits)),
            ctypes.c_void_p(got.data_ptr()),
        )
        assert torch.equal(got[finite].view(torch.int32), values.view(torch.int32)), dtype
        ordered, top = values.sort().values, torch.finfo(dtype).max
        x = torch.cat(
            [torch.randn(20000, generator=g) * 10.0**e for e in range(-40, 31, 5)]
            + [values, (ordered[:-1] + ordered[1:]) / 2, torch.tensor([3 * top, -0.0])]
        )
        want = x.clamp(-top, top).to(dtype)
        out = torch.empty_like(want)
        lib.encode_all(
            kv,
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_int64(len(x)),
            ctypes.c_void_p(out.data_ptr()),
        )
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), dtype


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (10, 2, 40)])
def test_decode_attention_of_a_verify_equals_each_row_alone(num_heads, num_kv_heads, head_dim):
    """A speculative verify's rows (one table row, consecutive lengths, one of them past a
    128-position work item) next to another sequence: each row's output is bitwise the one it
    gets alone, and matches SDPA over its prefix."""
    k, g = _kernels(), torch.Generator().manual_seed(3)
    slots = 300
    kc, vc = (torch.randn(slots, num_kv_heads, head_dim, generator=g) for _ in range(2))
    page_table = torch.randperm(slots, generator=g).to(torch.int32).view(2, -1).contiguous()
    table_rows = torch.tensor([1, 0, 0, 0, 0, 0])
    kv_lens = torch.tensor([90, 126, 127, 128, 129, 130])
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=g)
    out = torch.empty_like(q)
    args = (page_table, kc, vc)
    k.decode_attention(q, torch.arange(len(q)), table_rows, kv_lens, *args, out, head_dim**-0.5)
    group = num_heads // num_kv_heads
    for i in range(len(q)):
        alone = torch.empty(1, num_heads, head_dim)
        k.decode_attention(
            q[i : i + 1], torch.zeros(1, dtype=torch.int64), table_rows[i : i + 1],
            kv_lens[i : i + 1], *args, alone, head_dim**-0.5,
        )  # fmt: skip
        assert torch.equal(alone[0], out[i])
        slots_i = page_table[table_rows[i], : kv_lens[i]].long()
        keys, values = (c[slots_i].repeat_interleave(group, 1).transpose(0, 1) for c in (kc, vc))
        want = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(out[i], want, atol=ATOL, rtol=ATOL)


def test_seeded_uniform_is_bit_for_bit_the_torch_formula():
    from minisgl.engine.sampler import seeded_uniform

    seeds = torch.tensor([0, 1, 2**40 + 5, 123456789, 2**63 - 1])
    positions = torch.tensor([0, 5, 100000, 3, 2**33])
    got = _kernels().seeded_uniform(seeds, positions, 1003)
    assert torch.equal(got, seeded_uniform(seeds, positions, 1003))  # no kernels: torch ops


def _sampler(kernels: bool = True):
    """The CPU's sampler, with its kernels or (False) torch ops only."""
    from minisgl.engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    assert sampler.cpu_kernels is not None
    if not kernels:
        sampler.cpu_kernels = None
    return sampler


def _sampling_batch(params, seeds, positions, vocab):
    from minisgl.engine.device import ComputeStream
    from minisgl.engine.sampling_batch import SamplingBatch

    return SamplingBatch.build(params, seeds, positions, vocab, ComputeStream(torch.device("cpu")))


def test_sampling_kernel_draws_the_torch_path_tokens():
    """Temperature sampling (and greedy rows) in one kernel pass: the same tokens as the torch
    formula on every row (only a near-tie within fp32 rounding could differ)."""
    from minisgl.core import SamplingParams

    vocab, rows = 5003, 48
    logits = _randn(rows, vocab, seed=16) * 4
    temps = [0.0 if i % 7 == 0 else 0.2 + 0.05 * i for i in range(rows)]
    params = [SamplingParams(temperature=t) for t in temps]
    batch = _sampling_batch(params, list(range(rows)), [3 * i for i in range(rows)], vocab)
    got = _sampler().sample(logits, batch).token_ids
    want = _sampler(kernels=False).sample(logits, batch).token_ids
    assert torch.equal(got, want)
    assert len(set(got.tolist())) > rows // 2  # it did sample, not collapse to one token


@pytest.mark.parametrize("vocab", [5, 17, 1000, 151936])
def test_greedy_kernel_is_torch_argmax(vocab, monkeypatch):
    """An all-greedy batch takes the kernel's vector argmax: torch.argmax's ids, ties to the
    first (within and across vector lanes and the tail), rows of -inf included."""
    from minisgl.core import SamplingParams
    from minisgl.engine.sampler import Sampler

    rows = 12
    logits = _randn(rows, vocab, seed=vocab)
    logits[0] = float("-inf")
    logits[1] = 1.0  # all equal: id 0
    if vocab > 3:
        logits[2, 1] = logits[2, vocab - 1] = 99.0  # the first of two maxima
        logits[3, vocab - 1] = 99.0  # in the tail
    params = [SamplingParams(temperature=0)] * rows
    batch = _sampling_batch(params, [0] * rows, [0] * rows, vocab)
    calls = []
    real = Sampler.argmax
    monkeypatch.setattr(Sampler, "argmax", lambda *a: calls.append(1) or real(*a))
    got = _sampler().sample(logits, batch).token_ids
    assert calls and torch.equal(got, logits.argmax(dim=-1))


def test_sampling_kernel_after_the_grammar_mask_and_penalties():
    """The kernel draws from the logits after the grammar mask (-inf) and the penalties: the
    torch path's tokens, never a masked one, and logprobs still of the raw logits."""
    from minisgl.core import SamplingParams

    vocab, rows = 1000, 12
    logits = _randn(rows, vocab, seed=17) * 3
    params = [
        SamplingParams(temperature=0.0 if i % 5 == 0 else 0.3 + 0.1 * i, logprobs=2)
        for i in range(rows)
    ]
    sb = _sampling_batch(params, [100 + i for i in range(rows)], [7] * rows, vocab)
    # rows 1, 5 and 8 constrained: a few allowed tokens each, the raw argmax among the banned
    allowed = {1: {3, 40, 41, 999}, 5: {int(logits[5].argmin()), 500}, 8: {7}}
    bits = torch.zeros(len(allowed), -(-vocab // 32), dtype=torch.int64)
    for k, tokens in enumerate(allowed.values()):
        for t in tokens:
            bits[k, t // 32] |= 1 << (t % 32)
    sb.mask = (
        torch.tensor(list(allowed)),
        torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32),
    )
    # repetition, presence and frequency penalties on every row: a prompt of tokens 0..39, an
    # output of 40..59 twice each, then two positions past the row's end
    history = [*range(40), *range(40, 60), *range(40, 60), vocab, vocab]
    history_ids = torch.tensor([history] * rows)
    in_output = (torch.arange(len(history)) >= 40)[None, :].expand(rows, -1)
    sb.history = (history_ids, in_output & (history_ids < vocab))
    sb.rows.repetition = torch.full((rows,), 1.3)
    sb.rows.presence, sb.rows.frequency = torch.full((rows,), 0.5), torch.full((rows,), 0.25)
    for seed in range(8):
        sb.rows.seeds = torch.arange(rows) + 1000 * seed
        got = _sampler().sample(logits, sb)
        want = _sampler(kernels=False).sample(logits, sb)
        assert torch.equal(got.token_ids, want.token_ids)
        for row, tokens in allowed.items():
            assert int(got.token_ids[row]) in tokens
        assert got.scores is not None and want.scores is not None
        assert torch.equal(got.scores.chosen, want.scores.chosen)


def _quick_compiler(folder: Path, before: str = "") -> str:
    """PATH with a `gcc` first that runs the real one at -O0 (the build tests check what is
    built when, not the code: 1.5 s instead of 14 here), after the shell lines `before`."""
    real = shutil.which("gcc") or shutil.which("cc")
    if real is None:
        pytest.skip("no C compiler")
    folder.mkdir()
    (fake := folder / "gcc").write_text(
        "#!/bin/sh\n" + before + 'for a do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_concurrent_first_builds_compile_once(tmp_path):
    """Processes that need the library at once (tp ranks, --dp replicas, test workers) take
    turns on the build lock: one compiles, the others load its library."""
    import subprocess
    import sys

    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
        "from minisgl.kernels import cpu; assert cpu.get() is not None"
    )
    path = _quick_compiler(tmp_path / "bin")
    env = {**os.environ, build.CACHE_DIR_ENV: str(tmp_path), "PATH": path}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sum("built the CPU kernels" in log for log in logs) == 1
    assert [f.suffix for f in (tmp_path / "kernels").iterdir() if f.suffix != ".lock"] == [".so"]
    assert (tmp_path / "kernels").stat().st_mode & 0o077 == 0  # private to the user


def test_rejected_native_flags_are_not_retried(tmp_path, monkeypatch):
    """A compiler that rejects -march=native: the first build falls back to portable flags; the
    next one goes straight to them (the failure is remembered next to the library)."""
    calls = tmp_path / "calls"
    rejects = 'case "$*" in *-march=native*) echo "unknown flag" >&2; exit 1;; esac\n'
    monkeypatch.setenv(
        "PATH", _quick_compiler(tmp_path / "bin", f'echo "$*" >> {calls}\n' + rejects)
    )
    monkeypatch.setenv(build.CACHE_DIR_ENV, str(tmp_path / "cache"))

    def native_attempts() -> int:
        lines = calls.read_text().splitlines() if calls.exists() else []
        return sum("-march=native" in line for line in lines)

    first = build.build_library()
    assert native_attempts() == 1
    first.unlink()  # force a rebuild: only the portable flags are tried
    assert build.build_library() == first
    assert native_attempts() == 1


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 20)])
def test_chunk_attention_does_not_depend_on_chunking_or_threads(num_heads, num_kv_heads, head_dim):
    """A prompt's rows are bitwise the same prefilled as one chunk (its 2,100 positions: three
    of the kernel's segments, two waves of blocks for 9 heads), as three (each after a cached
    prefix, one ending inside a segment), and with one thread or two."""
    k, g = _kernels(), torch.Generator().manual_seed(4)
    n, slots = 2100, torch.randperm(2200, generator=g).to(torch.int32)[:2100]
    kc, vc = (torch.randn(2200, num_kv_heads, head_dim, generator=g) for _ in range(2))
    q = torch.randn(n, num_heads, head_dim, generator=g)
    whole, split = torch.empty_like(q), torch.empty_like(q)
    k.chunk_attention(q, whole, slots, kc, vc, head_dim**-0.5, (1.0, 1.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (slice(0, 67), slice(67, 1000), slice(1000, n)):
            args = (slots[: rows.stop], kc, vc, head_dim**-0.5, (1.0, 1.0))
            k.chunk_attention(q[rows], split[rows], *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, split)


# ---- whole models -------------------------------------------------------------------------------

PROMPTS = [[5, 17, 300, 2, 9] * 3, [42], list(range(100, 140)), [7, 7, 7, 1000, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _generate(model_dir, **options):
    with LLM(str(model_dir), dtype="float32", num_pages=256, page_size=4, **options) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        llm.check_page_accounting()
        return outs, llm.scheduler.engine.model  # type: ignore[attr-defined]


def _assert_same(outs, ref_outs) -> None:
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.token_ids == ref.token_ids
        for lp, ref_lp in zip(out.logprobs, ref.logprobs, strict=True):
            assert lp.logprob == pytest.approx(ref_lp.logprob, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_models_match_the_torch_path(tiny_models, monkeypatch, arch):
    """Kernels (fused decode stack included) vs MINISGL_CPU_KERNELS=0, same greedy tokens;
    qwen2 has q/k/v biases and tied embeddings, qwen3 per-head q/k norms."""
    outs, model = _generate(tiny_models[arch])
    assert model.cpu_decode_stack is not None
    assert model.model.layers[0].self_attn.qkv_proj.packed is not None
    monkeypatch.setenv(cpu.ENABLE_ENV, "0")
    cpu.get.cache_clear()
    try:
        ref_outs, ref_model = _generate(tiny_models[arch])
        assert ref_model.model.layers[0].self_attn.qkv_proj.packed is None
    finally:
        cpu.get.cache_clear()
    _assert_same(outs, ref_outs)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "bf16", "fp16"])
def test_fused_stack_matches_op_by_op_kernels(tiny_qwen3, monkeypatch, kv_cache_dtype):
    """The one-call decode stack runs the op-by-op kernels in the same order: equal tokens.
    With an fp8 or 16-bit pool the stack rounds K/V in C, the op-by-op path in torch: the same
    codes."""
    outs, _ = _generate(tiny_qwen3, kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr("minisgl.models.cpu_decoder.CpuDecodeStack.build", lambda *a: None)
    op_outs, model = _generate(tiny_qwen3, kv_cache_dtype=kv_cache_dtype)
    assert model.cpu_decode_stack is None
    _assert_same(outs, op_outs)


def test_without_a_compiler_the_torch_path_serves(tiny_qwen3, monkeypatch, caplog):
    monkeypatch.setattr(build, "COMPILERS", ("no-such-compiler-here",))
    cpu.get.cache_clear()
    try:
        assert cpu.get() is None
        assert "CPU kernels unavailable" in caplog.text
        outs, model = _generate(tiny_qwen3)
        assert model.cpu_decode_stack is None
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    finally:
        cpu.get.cache_clear()


def test_overlap_defaults_off_on_cpu_and_on_on_cuda(monkeypatch):
    """Overlap scheduling only adds contention on CPU (the forward keeps every core busy):
    `auto` leaves it off there and on for CUDA; `on` / `off` and the env flag override."""
    from minisgl.config import DISABLE_OVERLAP_ENV, ServerArgs

    monkeypatch.delenv(DISABLE_OVERLAP_ENV, raising=False)
    auto = ServerArgs.from_kwargs()
    assert auto.overlap == "auto"
    assert not auto.overlap_enabled("cpu") and auto.overlap_enabled("cuda")
    assert ServerArgs.from_kwargs(overlap="on").overlap_enabled("cpu")
    assert not ServerArgs.from_kwargs(overlap="off").overlap_enabled("cuda")
    monkeypatch.setenv(DISABLE_OVERLAP_ENV, "1")
    assert not ServerArgs.from_kwargs(overlap="on").overlap_enabled("cuda")


def test_lm_head_reuses_one_logits_buffer():
    """The CPU LM head writes every step's logits into one buffer (a fresh [rows, vocab] each
    step page-faults in again): right values each time, the same memory while it fits, grown
    when a larger batch comes."""
    from minisgl.layers.embedding import ParallelLMHead

    vocab, hidden = 1000, 64
    head = ParallelLMHead(vocab, hidden)
    weight = _randn(vocab, hidden, seed=20)
    head.weight.data.copy_(weight)
    head.use_cpu_kernels(_kernels(), keep_weight=True)
    pointers = []
    for rows, seed in ((8, 21), (3, 22), (8, 23), (40, 24), (5, 25)):
        x = _randn(rows, hidden, seed=seed)
        logits = head.compute_logits(x)
        torch.testing.assert_close(logits, x @ weight.T, atol=1e-4, rtol=1e-5)
        pointers.append(logits.data_ptr())
    assert len(set(pointers[:3])) == 1  # 8, 3, 8 rows: one buffer
    assert pointers[3] != pointers[0] and pointers[4] == pointers[3]  # grown for 40, kept
