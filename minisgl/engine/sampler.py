"""Batched sampling: the logits processors (structured-output mask, logit_bias, min_tokens
bans, penalties), temperature, top-k / top-p / min-p, seeded draws, logprobs.

The processors work out of place (the raw logits stay what logprobs report) and cost nothing
for a batch that does not use them. Randomness is counter-based: a uniform is a hash of
(request seed, position, vocab id), so a request's draws are reproducible whatever else is in
the batch and identical on every tensor-parallel rank."""

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from minisgl.engine.batch import TokenScores
from minisgl.engine.sampling_batch import RowInputs, SamplingBatch
from minisgl.kernels import cpu
from minisgl.kernels.cpu_ops import CpuKernels
from minisgl.kernels.gpu import triton_kernels

_MASK32 = 0xFFFFFFFF
# u = (top bits of the hash + 0.5) / 2^bits. 23 bits keep every u exact in float32 and < 1:
# with 24, the top value (2^24 - 0.5) / 2^24 rounds to 1.0, -log(u) = 0, and that token won
# the race whatever its probability (about 1 draw in 110 over a 150k vocabulary).
_UNIFORM_BITS = 23


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer (lowbias32). x: int64 holding values in [0, 2^32).

    int64 products may wrap, which keeps the low 32 bits right: they are all we keep.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(
    seeds: Tensor, positions: Tensor, vocab_size: int, kernels: CpuKernels | None = None
) -> Tensor:
    """Uniform (0, 1) numbers of shape [rows, vocab] for int64 seeds and positions [rows]; a
    pure function of (seed, position, id). With the CPU kernels one call computes the same bits
    (the tensor formula makes a dozen int64 [rows, vocab] temporaries)."""
    if kernels is not None:
        return kernels.seeded_uniform(seeds, positions, vocab_size)
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return seeded_uniform_at(seeds, positions, ids[None, :])


def seeded_uniform_at(seeds: Tensor, positions: Tensor, ids: Tensor) -> Tensor:
    """`seeded_uniform(seeds, positions, vocab)[row, ids[row, j]]` for int64 ids [rows or 1, k],
    computed for those ids only."""
    row_key = _mix32((_mix32(seeds & _MASK32) ^ positions) & _MASK32)  # [rows]
    h = _mix32((row_key[:, None] * 0x9E3779B1 + ids) & _MASK32)
    return _unit_interval(_mix32(h ^ row_key[:, None]))


def _unit_interval(h: Tensor) -> Tensor:
    """32-bit hashes (int64) to float32 uniforms strictly inside (0, 1)."""
    return ((h >> (32 - _UNIFORM_BITS)).float() + 0.5) / float(1 << _UNIFORM_BITS)


_BITS_PER_BYTE = 8


@functools.cache
def _byte_bias(device: torch.device) -> Tensor:
    """[256, 8] float32: 0 where bit j of byte value b is set, -inf where it is not. Made on
    the device itself (no host copy), once per device."""
    values = torch.arange(256, device=device)[:, None]
    shifts = torch.arange(_BITS_PER_BYTE, device=device)[None, :]
    allowed = ((values >> shifts) & 1).bool()
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))


def apply_vocab_mask(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """-inf for every token a constrained row may not pick. Out of place: the raw logits stay
    what logprobs report (and may be a CUDA graph's static output).

    The packed words are read as bytes (little-endian: byte i of word w holds tokens
    32w + 8i .. 32w + 8i + 7) and each byte looks up its 8 biases in a table: one gather and
    one add instead of unpacking bit by bit (RESULTS.md section 8)."""
    if sb.mask is None:
        return logits
    rows, bits = sb.mask
    as_bytes = bits.contiguous().view(torch.uint8).long()  # [k, words * 4]
    bias = _byte_bias(logits.device)[as_bytes].flatten(1)[:, : logits.shape[-1]]  # [k, vocab]
    return logits.index_put((rows,), logits[rows] + bias)


def apply_logit_bias(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """The requests' logit_bias added to their rows. Out of place, like the mask."""
    if sb.bias is None:
        return logits
    rows, ids, values = sb.bias
    return logits.index_put((rows, ids), values, accumulate=True)


def apply_bans(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """min_tokens: -inf for each row's stop tokens, except in a row where nothing else is
    allowed (a structured output whose grammar can only end): the grammar wins, as a row of
    only -inf would draw a token the grammar forbids."""
    if sb.bans is None:
        return logits
    banned = logits.index_put(sb.bans, logits.new_tensor(float("-inf")))
    something_left = banned.amax(dim=-1, keepdim=True) > float("-inf")
    return torch.where(something_left, banned, logits)


def apply_penalties(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """Repetition (HF / vLLM: positive logits divided, negative multiplied) on every token of
    prompt or output; then frequency x count and presence for tokens of the output (OpenAI).

    Only the tokens a row has seen change: each row's history sorted by (token, output first), the
    first position of each token's run writes its token's new value in one scatter into a copy of
    the logits (a spare column takes the padding). Fixed shapes: nothing waits for the device."""
    if sb.history is None:
        return logits
    rows, vocab = logits.shape
    ids, in_output = sb.history
    key = ids * 2 + (~in_output).long()  # a token's output positions sort before its prompt ones
    key, _ = key.sort(dim=1)
    ids, in_output = key // 2, key % 2 == 0
    starts = torch.ones_like(in_output)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = starts.long().cumsum(dim=1) - 1  # [rows, length]: each position's run
    counts = torch.zeros_like(run).scatter_add_(1, run, in_output.long())
    count = counts.gather(1, run).float()  # the position's token's times in the output
    values = logits.gather(1, ids.clamp(max=vocab - 1))
    penalty = sb.rows.repetition[:, None]
    values = torch.where(values > 0, values / penalty, values * penalty)
    values = values - sb.rows.frequency[:, None] * count
    values = values - sb.rows.presence[:, None] * (count > 0).float()
    # Only each run's first position writes (its token's one new value); the rest, and the
    # positions past a row's end (ids == vocab), write into the spare column.
    target = torch.where(starts & (ids < vocab), ids, vocab)
    out = torch.cat([logits, logits.new_zeros(rows, 1)], dim=1)
    return out.scatter_(1, target, values)[:, :vocab]


def process_logits(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """All of the above, in vLLM's order: logits processors (the bias first; -inf stays -inf),
    then penalties."""
    logits = apply_vocab_mask(apply_logit_bias(logits, sb), sb)
    return apply_penalties(apply_bans(logits, sb), sb)


# On CPU a filtered draw first tries this many candidates: a small topk instead of sorting the
# vocabulary (RESULTS.md section 11). Enough whenever the top-p nucleus or the min-p cut ends
# inside it, which `_cut_inside` checks (free on CPU; on CUDA it would be a sync).
CPU_FIRST_CANDIDATES = 256


def _keep(probs: Tensor, rows: RowInputs) -> Tensor:
    """Which of each row's candidates ([rows, k], most likely first) survive top-k, the top-p
    nucleus and min_p * max prob. The most likely token always does."""
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= rows.top_k[:, None]
    # A token is outside the nucleus when the mass before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= rows.top_p[:, None]
    drop |= probs < (rows.min_p * probs[:, 0])[:, None]
    drop[:, 0] = False
    return ~drop


def _cut_inside(probs: Tensor, rows: RowInputs) -> Tensor:
    """Per row ([rows] bool): whether it drops every token past these candidates ([rows, k],
    the k most likely), so that they are all the candidates it has and its draw is exact."""
    by_top_k = rows.top_k <= probs.shape[-1]
    by_top_p = probs.sum(dim=-1) >= rows.top_p  # the mass before candidate k + 1 reaches top_p
    by_min_p = probs[:, -1] < rows.min_p * probs[:, 0]  # every later token is below the cut
    return by_top_k | by_top_p | by_min_p


class SampleResult(NamedTuple):
    token_ids: Tensor  # int64 [rows]
    scores: TokenScores | None  # the chosen tokens' logprobs; None when no row wants them


class Sampler:
    """Draws a batch's tokens from its logits (float32 [rows, vocab], raw from the model).

    Which kernels it calls is settled here, once, for its device: on CUDA the Triton kernel for
    the temperature draw, on the CPU the C kernels (the temperature draw, the greedy argmax, the
    seeded uniforms), torch ops for everything else. `cpu_kernels = None` forces the torch ops
    (what tests compare against)."""

    def __init__(self, device: torch.device) -> None:
        self.triton_kernels = triton_kernels("triton_sampling", device)
        self.cpu_kernels = cpu.kernels_for(device, torch.float32)

    def sample(self, logits: Tensor, sb: SamplingBatch) -> SampleResult:
        raw_logits = logits
        logits = process_logits(logits, sb)
        if all(p.is_greedy for p in sb.params):
            token_ids = self.argmax(logits)
        elif sb.filter_rows is None:
            token_ids = self._draw_all(logits, sb.rows)
        else:
            token_ids = logits.new_empty(logits.shape[0], dtype=torch.int64)
            if (plain := sb.plain_rows) is not None:
                token_ids[plain] = self._draw_all(logits[plain], sb.rows.take(plain))
            rows = sb.filter_rows
            token_ids[rows] = self._draw_filtered(
                logits[rows], sb.rows.take(rows), sb.num_candidates
            )
        # Logprobs of the model's own distribution (before penalties and temperature), as vLLM:
        # the most alternatives a row wants (None: no row wants logprobs).
        max_k = max((p.logprobs for p in sb.params if p.logprobs is not None), default=None)
        scores = None if max_k is None else TokenScores.of(raw_logits, token_ids, max_k)
        return SampleResult(token_ids, scores)

    def argmax(self, logits: Tensor) -> Tensor:
        """logits.argmax(-1); on CPU the sampling kernel's greedy path (temperature 0 on every
        row, so no seed or position is read): one vector pass per row over the threads
        (RESULTS.md section 13)."""
        if self.cpu_kernels is None:
            return logits.argmax(dim=-1)
        greedy = torch.zeros(logits.shape[0], dtype=torch.float32)
        unused = torch.zeros(logits.shape[0], dtype=torch.int64)
        return self.cpu_kernels.sample(logits, greedy, unused, unused)

    def _draw_all(self, logits: Tensor, rows: RowInputs) -> Tensor:
        """Exponential race over the whole vocabulary (greedy where the temperature is 0):
        argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i."""
        per_row = (rows.temperatures, rows.seeds, rows.positions)
        # One pass per row, no [rows, vocab] temporaries: the same draw as the formula below (on
        # CUDA a Triton kernel, on CPU a C kernel; RESULTS.md section 9 for the formula's cost).
        if self.triton_kernels is not None and logits.stride(-1) == 1:
            return self.triton_kernels.sample(logits, *per_row)
        if self.cpu_kernels is not None:
            return self.cpu_kernels.sample(logits, *per_row)
        greedy_ids = logits.argmax(dim=-1)
        probs = torch.softmax(logits / rows.temperatures.clamp(min=1e-5)[:, None], dim=-1)
        u = seeded_uniform(rows.seeds, rows.positions, logits.shape[-1])
        sampled = (probs / -torch.log(u)).argmax(dim=-1)
        return torch.where(rows.temperatures == 0, greedy_ids, sampled)

    def _draw_filtered(self, logits: Tensor, rows: RowInputs, num_candidates: int) -> Tensor:
        """The race among each row's surviving candidates (rows with a temperature > 0): the
        same draw as racing over the vocabulary with every dropped token's probability set
        to 0."""
        probs = torch.softmax(logits / rows.temperatures.clamp(min=1e-5)[:, None], dim=-1)
        if logits.device.type != "cpu" or num_candidates <= CPU_FIRST_CANDIDATES:
            return self._race(probs.topk(num_candidates, dim=-1), rows, logits.shape[-1])
        short = probs.topk(CPU_FIRST_CANDIDATES, dim=-1)
        decided = _cut_inside(short[0], rows)
        if bool(decided.all()):
            return self._race(short, rows, logits.shape[-1])
        # The rows whose cut lies further down take the longer list; only they pay for it.
        token_ids = torch.empty(logits.shape[0], dtype=torch.int64)
        short_kept = (short[0][decided], short[1][decided])
        token_ids[decided] = self._race(short_kept, rows.take(decided), logits.shape[-1])
        rest = ~decided
        long = probs[rest].topk(num_candidates, dim=-1)
        token_ids[rest] = self._race(long, rows.take(rest), logits.shape[-1])
        return token_ids

    def _race(self, candidates: tuple[Tensor, Tensor], rows: RowInputs, vocab_size: int) -> Tensor:
        """Token ids [rows]: the exponential race among the candidates (probabilities and ids
        [rows, k], most likely first) that top-k, top-p and min-p keep."""
        cand_probs, cand_ids = candidates
        kept = cand_probs.masked_fill(~_keep(cand_probs, rows), 0.0)
        if cand_ids.shape[-1] == vocab_size:  # every token: the whole row's uniforms (a kernel)
            u = seeded_uniform(rows.seeds, rows.positions, vocab_size, self.cpu_kernels)
            u = u.gather(1, cand_ids)
        else:
            u = seeded_uniform_at(rows.seeds, rows.positions, cand_ids)
        choice = (kept / -torch.log(u)).argmax(dim=-1, keepdim=True)
        return cand_ids.gather(1, choice).squeeze(1)
