"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Randomness is counter-based: the uniform number for (request seed, token position, vocab id) is
a hash of those three integers. A request's draws therefore depend only on its own seed and
position: reproducible whatever else is in the batch, identical on every tensor-parallel rank,
and free of per-request generator objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams
from minisgl.engine.device import Device
from minisgl.kernels.cpu import get as cpu_kernels

_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 24  # float32 mantissa: more bits would round away


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32). x: int64 holding values in [0, 2^32).

    int64 products may wrap, which keeps the low 32 bits right: they are all we keep.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) numbers of shape [rows, vocab]; a pure function of (seed, position, id).
    On CPU one kernel call computes the same bits (the tensor formula below costs ~1 ms per
    row of a 49k vocabulary)."""
    kernels = cpu_kernels() if seeds.device.type == "cpu" else None
    if kernels is not None and seeds.dtype == positions.dtype == torch.int64:
        return kernels.seeded_uniform(seeds, positions, vocab_size)
    return _seeded_uniform_torch(seeds, positions, vocab_size)


def _seeded_uniform_torch(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    row_key = _mix32((_mix32(seeds & _MASK32) ^ positions) & _MASK32)  # [rows]
    h = _mix32((row_key[:, None] * 0x9E3779B1 + ids[None, :]) & _MASK32)
    h = _mix32(h ^ row_key[:, None])
    return ((h >> (32 - _UNIFORM_BITS)).float() + 0.5) / float(1 << _UNIFORM_BITS)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, on the device. Built by the engine from the requests' params."""

    temperatures: torch.Tensor  # float32 [rows]; 0 rows are greedy
    top_k: torch.Tensor  # int64 [rows]; vocab size when off
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    seeds: torch.Tensor  # int64 [rows]
    positions: torch.Tensor  # int64 [rows]: position of the token being sampled
    all_greedy: bool
    needs_filter: bool  # any row uses top-k, top-p or min-p
    # penalties (None when no row uses them)
    repetition: torch.Tensor | None = None  # float32 [rows]
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None  # bool [rows, vocab]: in prompt or output
    output_counts: torch.Tensor | None = None  # float32 [rows, vocab]: times in the output
    max_logprobs: int | None = None  # None: no row wants logprobs
    # structured outputs (None when no row is constrained)
    mask_rows: torch.Tensor | None = None  # int64 [k]: the constrained rows
    mask_bits: torch.Tensor | None = None  # int32 [k, ceil(vocab / 32)]: allowed tokens

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        vocab_size: int,
        device: Device,
    ) -> SamplingBatch:
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        wants = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.is_greedy for p in params)
        # One staged copy per dtype: building each tensor on the device would wait for the stream.
        temperatures, top_p, min_p = device.stage(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32),
        )
        top_k_t, seeds_t, positions_t = device.stage(
            torch.tensor(top_k, dtype=torch.int64),
            torch.tensor(seeds, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
        )
        return SamplingBatch(
            temperatures=temperatures,
            top_k=top_k_t,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds_t,
            positions=positions_t,
            all_greedy=all_greedy,
            needs_filter=any(
                k < vocab_size or p.top_p < 1 or p.min_p > 0
                for k, p in zip(top_k, params, strict=True)
            ),
            max_logprobs=max(wants) if wants else None,
        )


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # int64 [rows]
    logprobs: torch.Tensor | None  # float32 [rows]: chosen token's logprob
    top_ids: torch.Tensor | None  # int64 [rows, k]
    top_logprobs: torch.Tensor | None  # float32 [rows, k]


_BITS_PER_BYTE = 8
_byte_bias_tables: dict[torch.device, torch.Tensor] = {}


def _byte_bias(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: 0 where bit j of byte value b is set, -inf where it is not. Made on
    the device itself (no host copy), once per device."""
    table = _byte_bias_tables.get(device)
    if table is None:
        values = torch.arange(256, device=device)[:, None]
        shifts = torch.arange(_BITS_PER_BYTE, device=device)[None, :]
        allowed = ((values >> shifts) & 1).bool()
        table = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
        _byte_bias_tables[device] = table
    return table


def apply_vocab_mask(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """-inf for every token a constrained row may not pick. Out of place: the raw logits stay
    what logprobs report (and may be a CUDA graph's static output).

    The packed words are read as bytes (little-endian: byte i of word w holds tokens
    32w + 8i .. 32w + 8i + 7) and each byte looks up its 8 biases in a table: one gather and
    one add, ~30x faster on CPU than unpacking bit by bit."""
    if sb.mask_rows is None or sb.mask_bits is None:
        return logits
    vocab_size = logits.shape[-1]
    as_bytes = sb.mask_bits.contiguous().view(torch.uint8).long()  # [k, words * 4]
    bias = _byte_bias(logits.device)[as_bytes].flatten(1)[:, :vocab_size]  # [k, vocab]
    masked = logits[sb.mask_rows] + bias
    return logits.index_put((sb.mask_rows,), masked)


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    if sb.repetition is not None and sb.seen_mask is not None:
        # HF / vLLM convention: divide positive logits, multiply negative ones.
        penalty = sb.repetition[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(sb.seen_mask, penalized, logits)
    if sb.output_counts is not None and sb.frequency is not None and sb.presence is not None:
        logits = logits - sb.frequency[:, None] * sb.output_counts
        logits = logits - sb.presence[:, None] * (sb.output_counts > 0).float()
    return logits


def _filter(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Zero out tokens outside top-k, the top-p nucleus, or below min_p * max prob."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= sb.top_k[:, None]
    # A token is outside the nucleus when the mass before it already reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= sb.top_p[:, None]
    drop |= sorted_probs < (sb.min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """logits: float32 [rows, vocab], raw from the model."""
    raw_logits = logits
    logits = apply_penalties(apply_vocab_mask(logits, sb), sb)
    kernels = cpu_kernels() if logits.device.type == "cpu" else None
    if (
        kernels is not None
        and logits.dtype == torch.float32
        and not sb.all_greedy
        and not sb.needs_filter
    ):
        # One pass per row, no [rows, vocab] temporaries; the same formula as below.
        token_ids = kernels.sample(logits, sb.temperatures, sb.seeds, sb.positions)
    elif sb.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        greedy_ids = logits.argmax(dim=-1)
        temps = sb.temperatures.clamp(min=1e-5)[:, None]
        probs = torch.softmax(logits / temps, dim=-1)
        if sb.needs_filter:
            probs = _filter(probs, sb)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        u = seeded_uniform(sb.seeds, sb.positions, logits.shape[-1])
        sampled = (probs / -torch.log(u)).argmax(dim=-1)
        token_ids = torch.where(sb.temperatures == 0, greedy_ids, sampled)
    if sb.max_logprobs is None:
        return SampleResult(token_ids, None, None, None)
    # Logprobs of the model's own distribution (before penalties and temperature), as vLLM.
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(sb.max_logprobs, dim=-1)  # k = 0 gives empty
    return SampleResult(token_ids, chosen, top_ids, top_logprobs)
