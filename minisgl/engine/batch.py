"""What the scheduler hands the engine (`ForwardBatch`) and gets back (`PendingOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams, TokenLogprob
from minisgl.engine.device import Event


@dataclass(frozen=True)
class ForwardBatch:
    """One step's work, as plain host data. Sequence i computes positions
    [prefix_lens[i], prefix_lens[i] + extend_lens[i]) of table row table_rows[i]; when
    sampling[i] is set it also samples the token at the next position."""

    table_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling: list[SamplingParams | None]
    seeds: list[int]
    prompt_lens: list[int]  # where the output starts (frequency / presence penalties)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.table_rows)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling: the shape CUDA graphs replay."""
        return all(e == 1 for e in self.extend_lens) and all(p is not None for p in self.sampling)

    @property
    def kv_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]


@dataclass(frozen=True)
class VocabMask:
    """Which tokens some sampled rows may pick (structured outputs), as host data.

    rows: indices into the batch's sampled rows (sampling order); bitmask: int32
    [len(rows), ceil(vocab / 32)], bit j of word w set when token 32 * w + j is allowed
    (xgrammar's layout). Rows not listed are unconstrained.
    """

    rows: list[int]
    bitmask: torch.Tensor

    def __post_init__(self) -> None:
        assert self.bitmask.dtype == torch.int32 and self.bitmask.shape[0] == len(self.rows)


@dataclass(frozen=True)
class ForwardOutput:
    """Sampled tokens, one per sequence with sampling set, in batch order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class PendingOutput:
    """A launched forward's sampled tokens, on their way to the host.

    The tensors are host copies started with non-blocking transfers; `result()` waits for the
    event recorded after them, so only the caller that needs the tokens ever waits.
    """

    params: list[SamplingParams]
    token_ids: torch.Tensor | None  # int64 [rows]
    logprobs: torch.Tensor | None  # float32 [rows]
    top_ids: torch.Tensor | None  # int64 [rows, k]
    top_logprobs: torch.Tensor | None  # float32 [rows, k]
    ready: Event | None

    @staticmethod
    def empty() -> PendingOutput:
        return PendingOutput([], None, None, None, None, None)

    def result(self) -> ForwardOutput:
        if self.ready is not None:
            self.ready.wait()
        if self.token_ids is None:
            return ForwardOutput([], [])
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            assert self.top_ids is not None and self.top_logprobs is not None
            chosen = self.logprobs.tolist()
            top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
            for j, p in enumerate(self.params):
                if p.logprobs is None:
                    continue
                k = p.logprobs
                top = tuple(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
                logprobs[j] = TokenLogprob(token_ids[j], chosen[j], top)
        return ForwardOutput(token_ids, logprobs)
