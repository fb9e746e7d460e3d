"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the
tokens before it, from the logits of the position before it.

A prefill chunk of a scored request computes its logits at every position, not only the last:
`score_index` names those positions among the batch's tokens (they follow the sampled rows in
the logits), and `score_prompt` turns their logits into a `PromptScores`. The scheduler scores
at most PROMPT_LOGPROBS_STEP_TOKENS positions a step (scheduler/prefill.py), which bounds the
[positions, vocab] logits.
"""

from __future__ import annotations

import torch

from minisgl.engine.batch import ForwardBatch, PromptScores, TokenScores
from minisgl.engine.device import ComputeStream


def score_index(batch: ForwardBatch, starts: torch.Tensor) -> torch.Tensor | None:
    """Indices into the batch's flattened tokens whose logits score a prompt token (int64);
    None when nothing is scored. starts: int64 [seqs], each sequence's first token index."""
    counts = batch.num_prompt_scores
    if not any(counts):
        return None
    return torch.cat([starts[i] + torch.arange(c) for i, c in enumerate(counts) if c])


def score_prompt(
    batch: ForwardBatch, logits: torch.Tensor, token_table: torch.Tensor, stream: ComputeStream
) -> PromptScores:
    """logits: [scored, vocab], the rows of `score_index` in order. The scored tokens are read
    from the token table (the whole prompt is there from admission on)."""
    counts = batch.num_prompt_scores
    assert batch.prompt_logprobs is not None and logits.shape[0] == sum(counts)
    top_k = [(k or 0) if c else 0 for k, c in zip(batch.prompt_logprobs, counts, strict=True)]
    rows: list[int] = []
    positions: list[int] = []
    for row, prefix, count in zip(batch.table_rows, batch.prefix_lens, counts, strict=True):
        rows += [row] * count
        positions += range(prefix + 1, prefix + 1 + count)  # the token after each position
    rows_d, positions_d = stream.stage(torch.tensor(rows), torch.tensor(positions))
    token_ids = token_table[rows_d, positions_d].long()
    scores = TokenScores.of(logits, token_ids, max(top_k))
    host = stream.to_host_async
    return PromptScores(counts, top_k, host(token_ids), scores.map(host))
