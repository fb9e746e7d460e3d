"""What the scheduler hands the engine (`ForwardBatch`) and gets back (`PendingOutput`), with the
prompt logprobs a prefill chunk scores (`PromptScores`; docs/architecture.md#one-requests-life,
step 4)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.attention.base import host_tensor
from minisgl.core import Req, SamplingParams, TokenLogprob
from minisgl.engine.tables import DeviceTables
from minisgl.pooling import Pooling


@dataclass(eq=False)
class ForwardBatch:
    """One step's work, as plain host data. Sequence i computes positions
    [prefix_lens[i], prefix_lens[i] + extend_lens[i]) of table row table_rows[i]; when
    sampling[i] is set it also samples the token at the next position.

    The fields after prompt_logprobs are the scheduler's bookkeeping (scheduler/forward.py),
    which no engine code reads, up to the embeddings' `pooled_positions`."""

    table_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling: list[SamplingParams | None]
    seeds: list[int]
    prompt_lens: list[int]  # where the output starts (frequency / presence penalties)
    # Per sequence: top alternatives for the prompt logprobs of this chunk's positions (each
    # scores the prompt token after it), None where not wanted. None: no sequence wants them.
    prompt_logprobs: list[int | None] | None = None
    reqs: list[Req] = field(default_factory=list)  # per sequence, its request
    # max_tokens 0 (prompt logprobs only): requests whose prompt this batch completes
    scored_only: list[Req] = field(default_factory=list)
    with_drafts: bool = False  # speculative decoding: a request samples 1 + len(drafts) rows
    pending: PendingOutput | Future[PendingOutput] | None = None  # once launched
    launched_s: float = 0.0  # when (time.perf_counter()), for the step's cost
    # Requests that finished while this batch was in flight: their KV goes back once it is done
    release_after: list[Req] = field(default_factory=list)
    # By sequence of an embedding request: the positions of its chunk whose final states it
    # pools. The engine's forward sets `pooled`, what they add up: host copies (on CUDA on
    # their way), to read once the batch's `PendingOutput.result()` has returned.
    pooled_positions: dict[int, range] = field(default_factory=dict)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.table_rows)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling: the shape CUDA graphs replay. It scores
        no prompt token: a one-token chunk that samples is a prompt's last position."""
        # count and all: C speed (all() reads no SamplingParams' __eq__, only its truth)
        return self.extend_lens.count(1) == len(self.extend_lens) and all(self.sampling)

    @functools.cached_property
    def num_prompt_scores(self) -> list[int]:
        """Per sequence: how many positions of this chunk score a prompt token, counted from the
        chunk's start (position p scores prompt token p + 1; the prompt's last position
        predicts the first output token instead)."""
        if self.prompt_logprobs is None:
            return [0] * self.num_seqs
        lens = zip(self.prefix_lens, self.extend_lens, self.prompt_lens, strict=True)
        return [
            0 if k is None else max(0, min(prefix + extend, prompt_len - 1) - prefix)
            for k, (prefix, extend, prompt_len) in zip(self.prompt_logprobs, lens, strict=True)
        ]

    @functools.cached_property
    def sampled(self) -> list[int]:
        """The sequences that sample, in order (their logits come first). Decode steps, where
        all do, are built at C speed (`all` tests no SamplingParams for equality with None)."""
        if all(self.sampling):
            return list(range(self.num_seqs))
        return [i for i, p in enumerate(self.sampling) if p is not None]

    @functools.cached_property
    def rows(self) -> list[Req]:
        """Per sampled sequence (`sampled`), its request."""
        if len(self.sampled) == len(self.reqs):
            return self.reqs
        return [self.reqs[i] for i in self.sampled]

    @functools.cached_property
    def sampled_positions(self) -> list[int]:
        """Per sampled sequence: the position of the token it samples (its chunk's end)."""
        return [self.prefix_lens[i] + self.extend_lens[i] for i in self.sampled]

    @functools.cached_property
    def rows_and_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """table_rows and prefix_lens as int64 host tensors: a decode step's rows and the
        positions it computes, made once for the forward and the sampler."""
        return host_tensor(self.table_rows, torch.int64), host_tensor(self.prefix_lens, torch.int64)


def embedding_bytes(pooling: Pooling, total: torch.Tensor, prompt_len: int) -> bytes:
    """A request's embedding from the sum of its pooled states: their mean for mean pooling,
    its first `pooling.dimensions` if asked (Matryoshka), L2-normalised if asked, as float32
    little-endian bytes (what the API encodes as base64)."""
    vector = (total / prompt_len if pooling.mode == "mean" else total)[: pooling.dimensions]
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy().astype("<f4").tobytes()


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
        host = (t.tolist() for t in (self.chosen, self.top_ids, self.top_logprobs))
        rows = zip(token_ids, *host, top_k, strict=True)
        return [
            None if k is None else TokenLogprob(t, lp, tuple(zip(ids[:k], lps[:k], strict=True)))
            for t, lp, ids, lps, k in rows
        ]


@dataclass
class PromptScores:
    """A batch's prompt logprobs on their way to the host (copies started non-blocking)."""

    counts: list[int]  # per sequence: prompt tokens scored (ForwardBatch.num_prompt_scores)
    top_k: list[int]  # per sequence: alternatives wanted
    token_ids: torch.Tensor  # int64 [scored]: the scored prompt tokens, sequence by sequence
    scores: TokenScores

    @staticmethod
    def of(batch: ForwardBatch, logits: torch.Tensor, tables: DeviceTables) -> PromptScores:
        """logits: [scored, vocab], at the positions `num_prompt_scores` counts, in order. The
        scored tokens are read from the token table (the whole prompt is there from admission
        on)."""
        counts = batch.num_prompt_scores
        assert batch.prompt_logprobs is not None and logits.shape[0] == sum(counts)
        top_k = [(k or 0) if c else 0 for k, c in zip(batch.prompt_logprobs, counts, strict=True)]
        rows: list[int] = []
        positions: list[int] = []
        for row, prefix, count in zip(batch.table_rows, batch.prefix_lens, counts, strict=True):
            rows += [row] * count
            positions += range(prefix + 1, prefix + 1 + count)  # the token after each position
        stream = tables.stream
        rows_d, positions_d = stream.stage(torch.int64, rows, positions)
        token_ids = tables.token_table[rows_d, positions_d].long()
        scores = TokenScores.of(logits, token_ids, max(top_k))
        return PromptScores(
            counts, top_k, stream.to_host_async(token_ids), scores.map(stream.to_host_async)
        )

    def result(self) -> dict[int, list[TokenLogprob]]:
        row_k = [k for count, k in zip(self.counts, self.top_k, strict=True) for _ in range(count)]
        scored = iter(self.scores.token_logprobs(self.token_ids.tolist(), row_k))  # in order
        return {
            seq: [lp for lp in itertools.islice(scored, count) if lp is not None]
            for seq, count in enumerate(self.counts)
            if count
        }


@dataclass
class PendingOutput:
    """A launched forward's sampled tokens, on their way to the host.

    The tensors are host copies started with non-blocking transfers; `result()` waits for the
    event recorded after them, so only the caller that needs the tokens ever waits.
    """

    params: list[SamplingParams]
    token_ids: torch.Tensor | None = None  # int64 [rows]; None: nothing sampled
    scores: TokenScores | None = None  # None: no row wants logprobs
    ready: Any = None  # a torch.cuda.Event (ComputeStream.record_event); None: nothing to wait for
    prompt_scores: PromptScores | None = None

    def result(self) -> ForwardOutput:
        if self.ready is not None:
            self.ready.synchronize()
        scored = {} if self.prompt_scores is None else self.prompt_scores.result()
        if self.token_ids is None:
            return ForwardOutput([], [], scored)
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.scores is not None:
            logprobs = self.scores.token_logprobs(token_ids, [p.logprobs for p in self.params])
        return ForwardOutput(token_ids, logprobs, scored)
