"""Temperature sampling in one Triton kernel: the GPU twin of csrc/sampling.c's `mg_sample`, one
program per row reading its logits once (as torch ops the draw is ~30 passes over [rows, vocab]:
RESULTS.md section 9).

It is sampler.py's exponential race in log form, argmax_i logits_i / t - log(-log(u_i)), with
sampler.py's seeded uniforms bit for bit; temperature 0 takes the argmax, ties go to the lowest
id. Imported lazily (it imports triton); tests run it under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl
from torch import Tensor

# Vocabulary entries a program handles per iteration (~37 iterations for Qwen3's 151,936).
BLOCK = 4096
NUM_WARPS = 8
# sampler.py: _UNIFORM_BITS (the uniforms keep the hash's top 23 bits).
UNIFORM_BITS = 23
# sampler.py: a temperature is clamped to at least this before dividing.
MIN_TEMPERATURE = 1e-5


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 values (sampler.py's `_mix32`): products wrap mod 2^32."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperatures_ptr,
    seeds_ptr,
    positions_ptr,
    out_ptr,
    logits_row_stride,
    vocab_size,
    min_temperature,
    UNIFORM_SHIFT: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    # The row's key, as sampler.py's seeded_uniform_at: the low 32 bits of seed and position.
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    key = _mix32(_mix32(seed) ^ position)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.maximum(temperature, min_temperature)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    row_logits = logits_ptr + row * logits_row_stride
    for start in range(0, vocab_size, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        logits = tl.load(row_logits + ids, mask=ids < vocab_size, other=float("-inf"))
        logits = logits.to(tl.float32)
        h = _mix32(key * tl.full([], 0x9E3779B1, tl.uint32) + ids.to(tl.uint32))
        u = ((_mix32(h ^ key) >> UNIFORM_SHIFT).to(tl.float32) + 0.5) * UNIFORM_SCALE
        # Lanes past the vocabulary loaded -inf, which stays -inf either way.
        score = tl.where(greedy, logits, logits * inv_t - tl.log(-tl.log(u)))
        block_best = tl.max(score, axis=0)
        block_id = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int32) + start
        # Strictly greater: an equal score later in the row keeps the earlier id.
        better = block_best > best
        best, best_id = tl.where(better, block_best, best), tl.where(better, block_id, best_id)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def sample(logits: Tensor, temperatures: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """Token ids (int64 [rows]) drawn from logits ([rows, vocab], unit stride along the
    vocabulary; any float dtype) at float32 temperatures [rows] (0: greedy), with the seeded
    uniforms of int64 seeds and positions [rows]."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    out = logits.new_empty(rows, dtype=torch.int64)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperatures,
            seeds,
            positions,
            out,
            logits.stride(0),
            vocab_size,
            MIN_TEMPERATURE,
            UNIFORM_SHIFT=32 - UNIFORM_BITS,
            UNIFORM_SCALE=1.0 / (1 << UNIFORM_BITS),
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return out
