"""What the scheduler hands the engine (`ForwardBatch`) and gets back (`PendingOutput`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    # Per sequence: top alternatives for the prompt logprobs of this chunk's positions (each
    # scores the prompt token after it), None where not wanted. None: no sequence wants them.
    prompt_logprobs: list[int | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.table_rows)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling: the shape CUDA graphs replay. It scores
        no prompt token: a one-token chunk that samples is a prompt's last position."""
        return all(e == 1 for e in self.extend_lens) and all(p is not None for p in self.sampling)

    @functools.cached_property
    def num_prompt_scores(self) -> list[int]:
        """Per sequence: how many positions of this chunk score a prompt token, counted from the
        chunk's start (position p scores prompt token p + 1; the prompt's last position
        predicts the first output token instead)."""
        if self.prompt_logprobs is None:
            return [0] * self.num_seqs
        return [
            0 if k is None else max(0, min(prefix + extend, prompt_len - 1) - prefix)
            for k, prefix, extend, prompt_len in zip(
                self.prompt_logprobs,
                self.prefix_lens,
                self.extend_lens,
                self.prompt_lens,
                strict=True,
            )
        ]

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
    """Sampled tokens, one per sequence with sampling set, in batch order; and the prompt
    logprobs this batch scored, by sequence index (ForwardBatch.prompt_logprobs)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class TokenScores:
    """Logprobs of some chosen tokens and their top alternatives, a row per token: on the
    device, or host copies on their way (`map(stream.to_host_async)`)."""

    chosen: torch.Tensor  # float32 [rows]: each chosen token's logprob
    top_ids: torch.Tensor  # int64 [rows, max k]
    top_logprobs: torch.Tensor  # float32 [rows, max k]

    @staticmethod
    def of(logits: torch.Tensor, token_ids: torch.Tensor, max_k: int) -> TokenScores:
        """From logits [rows, vocab] and the chosen int64 token ids [rows]."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        top_logprobs, top_ids = logprobs.topk(max_k, dim=-1)  # k = 0 gives empty
        return TokenScores(chosen, top_ids, top_logprobs)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenScores:
        return TokenScores(fn(self.chosen), fn(self.top_ids), fn(self.top_logprobs))

    def token_logprobs(
        self, token_ids: list[int], top_k: Sequence[int | None]
    ) -> list[TokenLogprob | None]:
        """Per row (on the host): its TokenLogprob with its first top_k[row] alternatives, or
        None where top_k[row] is None (not wanted)."""
        chosen, top_ids, top_lps = (
            t.tolist() for t in (self.chosen, self.top_ids, self.top_logprobs)
        )
        return [
            None
            if k is None
            else TokenLogprob(
                token_ids[j], chosen[j], tuple(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
            )
            for j, k in enumerate(top_k)
        ]


@dataclass
class PromptScores:
    """A batch's prompt logprobs on their way to the host (copies started non-blocking)."""

    counts: list[int]  # per sequence: prompt tokens scored (ForwardBatch.num_prompt_scores)
    top_k: list[int]  # per sequence: alternatives wanted
    token_ids: torch.Tensor  # int64 [scored]: the scored prompt tokens, sequence by sequence
    scores: TokenScores

    def result(self) -> dict[int, list[TokenLogprob]]:
        row_k = [k for count, k in zip(self.counts, self.top_k, strict=True) for _ in range(count)]
        rows = self.scores.token_logprobs(self.token_ids.tolist(), row_k)
        out: dict[int, list[TokenLogprob]] = {}
        start = 0
        for seq, count in enumerate(self.counts):
            if count:
                out[seq] = [lp for lp in rows[start : start + count] if lp is not None]
                start += count
        return out


@dataclass
class PendingOutput:
    """A launched forward's sampled tokens, on their way to the host.

    The tensors are host copies started with non-blocking transfers; `result()` waits for the
    event recorded after them, so only the caller that needs the tokens ever waits.
    """

    params: list[SamplingParams]
    token_ids: torch.Tensor | None = None  # int64 [rows]; None: nothing sampled
    scores: TokenScores | None = None  # None: no row wants logprobs
    ready: Event | None = None
    prompt_scores: PromptScores | None = None

    def result(self) -> ForwardOutput:
        if self.ready is not None:
            self.ready.wait()
        scored = {} if self.prompt_scores is None else self.prompt_scores.result()
        if self.token_ids is None:
            return ForwardOutput([], [], scored)
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.scores is not None:
            logprobs = self.scores.token_logprobs(token_ids, [p.logprobs for p in self.params])
        return ForwardOutput(token_ids, logprobs, scored)
