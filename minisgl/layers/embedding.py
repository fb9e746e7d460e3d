"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.kernels.weights import QuantTensor, Weight, dense, huge_page_zeros
from minisgl.layers.linear import PackedWeight, frozen


class VocabParallelEmbedding(PackedWeight):
    """GGUF blocks (`quant`) stay blocks: rows are looked up and dequantized by token id."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        # Round up so every rank holds the same number of rows; padded rows stay zero.
        self.shard_vocab = (vocab_size + tp.size - 1) // tp.size
        self.vocab_start = tp.rank * self.shard_vocab
        self.weight = frozen(torch.zeros(self.shard_vocab, hidden_size))

    def load_weight(self, param: nn.Parameter, full: Weight) -> None:
        rows = max(0, min(self.shard_vocab, full.shape[0] - self.vocab_start))
        piece = full.narrow(0, self.vocab_start, rows)
        if isinstance(piece, QuantTensor) and rows == self.shard_vocab:
            self.quant = {0: piece}
        else:  # fp8, and blocks that leave padded rows, dequantized
            param.data[:rows].copy_(dense(piece))

    def _lookup(self, ids: Tensor) -> Tensor:
        if self.packed is not None and self.packed.segments and self._kernels is not None:
            return self._kernels.embed(self.packed, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: Tensor) -> Tensor:
        if get_tp_info().size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_vocab)
        out = self._lookup(local.clamp(0, self.shard_vocab - 1))
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h E^T over this rank's vocab slice, gathered to the full vocabulary. With the
    CPU kernels a tied fp32 weight is kept: the embedding looks rows of it up by token id (tied
    models hold the head twice); tied GGUF blocks are held once, by both."""

    # CPU: the logits go into this buffer, grown to the most rows seen and reused every step.
    # [rows, vocab] fp32 is large, and a fresh one each step costs page faults twice over:
    # glibc maps blocks over 32 MiB afresh and unmaps them on free (RESULTS.md section 12).
    # So the logits are valid until the next step's, as a CUDA graph's static output is.
    _logits_buffer: Tensor | None = None

    def compute_logits(self, hidden: Tensor) -> Tensor:
        out = None
        if self.packed is not None:
            rows, buffer = hidden.numel() // hidden.shape[-1], self._logits_buffer
            if buffer is None or buffer.shape[0] < rows or buffer.dtype != hidden.dtype:
                # batches ramp up a row at a time
                grown = 0 if buffer is None else 2 * buffer.shape[0]
                shape = (max(rows, grown), self.packed.out_features)
                buffer = self._logits_buffer = huge_page_zeros(shape, hidden.dtype)
            out = buffer[:rows]
        return all_gather_last_dim(self.matmul(hidden, None, out))[..., : self.vocab_size]
