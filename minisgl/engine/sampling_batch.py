"""What the sampler draws with: every sampled row's parameters, seed and position, and the
optional parts (penalties with each row's token history, logit_bias, min_tokens bans, the
structured-output mask) as device tensors, staged in a few non-blocking copies."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from minisgl.core import SamplingParams
from minisgl.engine.batch import ForwardBatch, VocabMask
from minisgl.engine.device import ComputeStream
from minisgl.engine.tables import DeviceTables
from minisgl.models.model_config import ModelConfig

# The per-row float parameters, in RowInputs' order (staged in one copy).
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class RowInputs:
    """Every row's parameters, seed and position: a batch's (`SamplingBatch.rows`) or some
    rows' (`take`)."""

    temperatures: Tensor  # float32 [rows]; 0 rows are greedy
    top_p: Tensor  # float32 [rows]
    min_p: Tensor  # float32 [rows]
    # penalties (float32 [rows]); they apply only where SamplingBatch.history is set
    repetition: Tensor
    presence: Tensor
    frequency: Tensor
    top_k: Tensor  # int64 [rows]; vocab size when off
    seeds: Tensor  # int64 [rows]
    positions: Tensor  # int64 [rows]: position of the token being sampled

    def take(self, rows: Tensor) -> RowInputs:
        """These rows only (an index or a boolean mask)."""
        return RowInputs(*(getattr(self, f.name)[rows] for f in fields(self)))


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, on the device. Built by the engine from the requests' params
    (`for_batch`)."""

    params: list[SamplingParams]  # on the host, a row each
    rows: RowInputs
    # Rows that sample under top-k, top-p or min-p (int64 [f]) and the others (int64, None when
    # empty); filter_rows is None when no row filters. Filtered rows draw among their
    # `num_candidates` most likely tokens (the largest top-k among them, the vocabulary when one
    # has none), found with topk instead of sorting the vocabulary.
    filter_rows: Tensor | None
    plain_rows: Tensor | None
    num_candidates: int
    # The optional parts, each None when no row uses it.
    # Penalties: each row's tokens so far, prompt then output (int64 [rows, length], the
    # vocabulary size past a row's end), and which of those positions are output (bool, same).
    history: tuple[Tensor, Tensor] | None = None
    # logit_bias, flattened over the rows that set one: rows, token ids (int64 [entries]) and
    # values (float32 [entries]).
    bias: tuple[Tensor, Tensor, Tensor] | None = None
    # min_tokens: the (row, token) pairs that may not be drawn yet (int64 [entries] each).
    bans: tuple[Tensor, Tensor] | None = None
    # Structured outputs: the constrained rows (int64 [k]) and their allowed tokens (int32 [k,
    # ceil(vocab / 32)]).
    mask: tuple[Tensor, Tensor] | None = None

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        vocab_size: int,
        stream: ComputeStream,
        output_lens: list[int] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplingBatch:
        """output_lens: tokens each row has generated (min_tokens: until a row has min_tokens,
        its stop tokens, EOS among them unless ignore_eos, are banned; see apply_bans)."""
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        filtered = [
            i
            for i, (k, p) in enumerate(zip(top_k, params, strict=True))
            if p.temperature > 0 and (k < vocab_size or p.top_p < 1 or p.min_p > 0)
        ]
        plain = sorted(set(range(len(params))) - set(filtered)) if filtered else []
        # One staged copy per dtype: building each tensor on the device would wait for the stream.
        floats = stream.stage(
            torch.float32, *([getattr(p, f) for p in params] for f in _FLOAT_PARAMS)
        )
        ints = stream.stage(torch.int64, top_k, seeds, positions, filtered, plain)
        sb = SamplingBatch(
            params,
            RowInputs(*floats, *ints[:3]),
            filter_rows=ints[3] if filtered else None,
            plain_rows=ints[4] if plain else None,
            num_candidates=max((top_k[i] for i in filtered), default=0),
        )
        banned: list[tuple[int, int]] = []
        for i, (p, done) in enumerate(zip(params, output_lens or [0] * len(params), strict=True)):
            if done < p.min_tokens:
                stops = {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
                banned += [(i, t) for t in sorted(stops) if t < vocab_size]
        if banned:
            ban_rows, ban_ids = stream.stage(torch.int64, *zip(*banned, strict=True))
            sb.bans = (ban_rows, ban_ids)
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if biased:
            bias_rows, bias_ids, bias_values = zip(*biased, strict=True)
            rows_d, ids_d = stream.stage(torch.int64, bias_rows, bias_ids)
            (values_d,) = stream.stage(torch.float32, bias_values)
            sb.bias = (rows_d, ids_d, values_d)
        return sb

    @staticmethod
    def for_batch(
        batch: ForwardBatch, cfg: ModelConfig, tables: DeviceTables, vocab_mask: VocabMask | None
    ) -> SamplingBatch:
        """The inputs of a batch's sampled sequences (ForwardBatch.sampled), in order; the
        penalties read each row's tokens so far from the token table."""
        seqs, stream = batch.sampled, tables.stream
        params = [p for p in batch.sampling if p is not None]
        next_pos = batch.sampled_positions
        prompt_lens = [batch.prompt_lens[i] for i in seqs]
        output_lens = [pos - prompt for pos, prompt in zip(next_pos, prompt_lens, strict=True)]
        seeds = [batch.seeds[i] for i in seqs]
        sb = SamplingBatch.build(
            params, seeds, next_pos, cfg.vocab_size, stream, output_lens, cfg.eos_token_ids
        )
        if vocab_mask is not None:
            (mask_rows,) = stream.stage(torch.int64, vocab_mask.rows)
            # One staged copy of the flattened bits (stage takes 1-D tensors): [k * words]
            (flat_bits,) = stream.stage(torch.int32, vocab_mask.bitmask.reshape(-1))
            sb.mask = (mask_rows, flat_bits.view(vocab_mask.bitmask.shape))
        if any(p.has_penalties for p in params):
            # Each row's tokens so far (prompt, then output), the vocabulary size past its end.
            max_len = max(next_pos)
            rows_d, prompt_lens_d, seq_lens_d = stream.stage(
                torch.int64, [batch.table_rows[i] for i in seqs], prompt_lens, next_pos
            )
            ids = tables.token_table[rows_d, :max_len].long()  # [rows, max_len]
            pos = torch.arange(max_len, device=stream.device)[None, :]
            in_seq = pos < seq_lens_d[:, None]
            in_output = in_seq & (pos >= prompt_lens_d[:, None])
            sb.history = (ids.masked_fill(~in_seq, cfg.vocab_size), in_output)
        return sb
