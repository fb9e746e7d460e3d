"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        # Round up so every rank holds the same number of rows; padded rows stay zero.
        self.shard_vocab = (vocab_size + tp.size - 1) // tp.size
        self.vocab_start = tp.rank * self.shard_vocab
        self.weight = nn.Parameter(torch.zeros(self.shard_vocab, hidden_size), requires_grad=False)

    def load_weight(self, param: nn.Parameter, full: torch.Tensor) -> None:
        rows = max(0, min(self.shard_vocab, full.shape[0] - self.vocab_start))
        param.data[:rows].copy_(full.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_vocab)
        out = F.embedding(local.clamp(0, self.shard_vocab - 1), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h E^T over this rank's vocab slice, gathered to the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
