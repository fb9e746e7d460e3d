"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.kernels.cpu import CpuKernels, PackedLinear


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

    _kernels: CpuKernels | None = None
    _packed: PackedLinear | None = None

    def use_cpu_kernels(self, kernels: CpuKernels, tied: bool) -> None:
        """Pack the (loaded) weight for the CPU kernels. A tied weight is the embedding's too,
        which looks rows up by token id, so it is kept (tied models hold the head twice);
        an untied one is freed."""
        self._packed = kernels.pack(self.weight.data)
        self._kernels = kernels
        if not tied:
            self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and self._packed is not None:
            logits = self._kernels.linear(hidden, self._packed)
        else:
            logits = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
