"""What the sampler draws with: every sampled row's parameters, seed and position, and the
optional parts (penalties with each row's token history, logit_bias, min_tokens bans, the
structured-output mask) as device tensors, staged in a few non-blocking copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams
from minisgl.engine.batch import ForwardBatch, VocabMask
from minisgl.engine.device import ComputeStream


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, on the device. Built by the engine from the requests' params
    (`for_batch`)."""

    temperatures: torch.Tensor  # float32 [rows]; 0 rows are greedy
    top_k: torch.Tensor  # int64 [rows]; vocab size when off
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    seeds: torch.Tensor  # int64 [rows]
    positions: torch.Tensor  # int64 [rows]: position of the token being sampled
    all_greedy: bool
    # Rows that sample under top-k, top-p or min-p (int64 [f]) and the others (int64, None when
    # empty); filter_rows is None when no row filters. Filtered rows draw among their
    # `num_candidates` most likely tokens (the largest top-k among them, the vocabulary when one
    # has none), found with topk instead of sorting the vocabulary.
    filter_rows: torch.Tensor | None
    plain_rows: torch.Tensor | None
    num_candidates: int
    # penalties (None when no row uses them)
    repetition: torch.Tensor | None = None  # float32 [rows]
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    # Each row's tokens so far, prompt then output: int64 [rows, length], the vocabulary size
    # past a row's end; and which of those positions are output (bool, same shape).
    history_ids: torch.Tensor | None = None
    history_in_output: torch.Tensor | None = None
    max_logprobs: int | None = None  # None: no row wants logprobs
    # logit_bias, flattened over the rows that set one (None when none does)
    bias_rows: torch.Tensor | None = None  # int64 [entries]
    bias_ids: torch.Tensor | None = None  # int64 [entries]
    bias_values: torch.Tensor | None = None  # float32 [entries]
    # min_tokens: (row, token) pairs that may not be drawn yet (None when none); see apply_bans
    ban_rows: torch.Tensor | None = None  # int64 [entries]
    ban_ids: torch.Tensor | None = None  # int64 [entries]
    # structured outputs (None when no row is constrained)
    mask_rows: torch.Tensor | None = None  # int64 [k]: the constrained rows
    mask_bits: torch.Tensor | None = None  # int32 [k, ceil(vocab / 32)]: allowed tokens

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
        wants = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.is_greedy for p in params)
        filtered = [
            i
            for i, (k, p) in enumerate(zip(top_k, params, strict=True))
            if p.temperature > 0 and (k < vocab_size or p.top_p < 1 or p.min_p > 0)
        ]
        plain = sorted(set(range(len(params))) - set(filtered)) if filtered else []
        # One staged copy per dtype: building each tensor on the device would wait for the stream.
        temperatures, top_p, min_p = stream.stage(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32),
        )
        top_k_t, seeds_t, positions_t, filter_rows, plain_rows = stream.stage(
            torch.tensor(top_k, dtype=torch.int64),
            torch.tensor(seeds, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(filtered, dtype=torch.int64),
            torch.tensor(plain, dtype=torch.int64),
        )
        sb = SamplingBatch(
            temperatures=temperatures,
            top_k=top_k_t,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds_t,
            positions=positions_t,
            all_greedy=all_greedy,
            filter_rows=filter_rows if filtered else None,
            plain_rows=plain_rows if plain else None,
            num_candidates=max((top_k[i] for i in filtered), default=0),
            max_logprobs=max(wants) if wants else None,
        )
        banned: list[tuple[int, int]] = []
        for i, (p, done) in enumerate(zip(params, output_lens or [0] * len(params), strict=True)):
            if done < p.min_tokens:
                stops = {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
                banned += [(i, t) for t in sorted(stops) if t < vocab_size]
        if banned:
            sb.ban_rows, sb.ban_ids = stream.stage(*torch.tensor(banned, dtype=torch.int64).T)
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if biased:
            rows_l, ids_l, values_l = zip(*biased, strict=True)
            sb.bias_rows, sb.bias_ids = stream.stage(
                torch.tensor(rows_l, dtype=torch.int64), torch.tensor(ids_l, dtype=torch.int64)
            )
            (sb.bias_values,) = stream.stage(torch.tensor(values_l, dtype=torch.float32))
        return sb

    @staticmethod
    def for_batch(
        batch: ForwardBatch,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        token_table: torch.Tensor,
        vocab_mask: VocabMask | None,
        stream: ComputeStream,
    ) -> SamplingBatch:
        """The inputs of a batch's sampled sequences (those with sampling params), in order;
        the penalties read each row's tokens so far from the token table."""
        seqs = [i for i, p in enumerate(batch.sampling) if p is not None]
        params = [p for p in batch.sampling if p is not None]
        kv_lens = batch.kv_lens
        next_pos = [kv_lens[i] for i in seqs]
        prompt_lens = [batch.prompt_lens[i] for i in seqs]
        sb = SamplingBatch.build(
            params,
            [batch.seeds[i] for i in seqs],
            next_pos,
            vocab_size,
            stream,
            output_lens=[pos - prompt for pos, prompt in zip(next_pos, prompt_lens, strict=True)],
            eos_token_ids=eos_token_ids,
        )
        if vocab_mask is not None:
            words = vocab_mask.bitmask.shape[1]
            (sb.mask_rows,) = stream.stage(torch.tensor(vocab_mask.rows, dtype=torch.int64))
            # One staged copy of the flattened bits (stage takes 1-D tensors): [k * words]
            (flat_bits,) = stream.stage(vocab_mask.bitmask.reshape(-1))
            sb.mask_bits = flat_bits.view(len(vocab_mask.rows), words)
        if any(p.has_penalties for p in params):
            # Each row's tokens so far (prompt, then output), the vocabulary size past its end.
            max_len = max(next_pos)
            rows_d, prompt_lens_d, seq_lens_d = stream.stage(
                torch.tensor([batch.table_rows[i] for i in seqs]),
                torch.tensor(prompt_lens),
                torch.tensor(next_pos),
            )
            ids = token_table[rows_d, :max_len].long()  # [rows, max_len]
            pos = torch.arange(max_len, device=stream.device)[None, :]
            in_seq = pos < seq_lens_d[:, None]
            sb.history_ids = ids.masked_fill(~in_seq, vocab_size)
            sb.history_in_output = in_seq & (pos >= prompt_lens_d[:, None])
            sb.repetition, sb.presence, sb.frequency = stream.stage(
                torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
                torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
                torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            )
        return sb
