"""One step's batch: the scheduled (request, tokens to compute) items become the engine's
`ForwardBatch`, and a `Launched` record of whose results it will bring back."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from minisgl.core import Req, SamplingParams
from minisgl.engine.batch import ForwardBatch, ForwardOutput, PendingOutput

_T = TypeVar("_T")


def resolved(value: _T | Future[_T]) -> _T:
    """A value computed here, or one the forward thread computes (CPU overlap)."""
    return value.result() if isinstance(value, Future) else value


@dataclass
class Launched:
    reqs: list[Req]
    sampled: list[Req]  # the requests that sample a token in this batch, in output order
    # max_tokens 0 (prompt logprobs only): requests whose prompt this batch completes
    scored_only: list[Req]
    with_drafts: bool = False  # speculative decoding: a request samples 1 + len(drafts) rows
    pending: PendingOutput | Future[PendingOutput] | None = None  # set once sampling launched
    release_after: list[Req] = field(default_factory=list)

    @property
    def rows(self) -> list[Req]:
        """Per sampled row, its request."""
        if not self.with_drafts:
            return self.sampled
        return [req for req in self.sampled for _ in range(1 + len(req.drafts))]

    def result(self) -> ForwardOutput:
        assert self.pending is not None
        return resolved(self.pending).result()


def build_batch(
    items: list[tuple[Req, int]], with_drafts: bool = False
) -> tuple[ForwardBatch, Launched]:
    """Advance each request by its tokens (`cached_len`; `device_len` by the token it will
    sample) and describe the work for the engine. `with_drafts`: some requests have drafts
    (speculative decoding); they advance by those verified, when the results are in."""
    reqs = [req for req, _ in items]
    prefix_lens = [req.cached_len for req in reqs]
    prompt_logprobs = [r.sampling_params.prompt_logprobs if r.scores_prompt else None for r in reqs]
    sampled: list[Req] = []
    scored_only: list[Req] = []  # max_tokens 0: the prompt ends here, nothing to sample
    sampling: list[SamplingParams | None] = []
    for req, num_tokens in items:
        req.cached_len += num_tokens
        at_end = req.cached_len == req.device_len
        if at_end and req.sampling_params.max_tokens > 0:  # sample the next token
            sampling.append(req.sampling_params)
            sampled.append(req)
            req.device_len += 1
            req.num_sampled += 1
        else:
            sampling.append(None)
            if at_end:
                scored_only.append(req)
    scoring = any(k is not None for k in prompt_logprobs)
    fb = ForwardBatch(
        [req.table_row for req in reqs], prefix_lens, [n for _, n in items], sampling,
        [req.seed for req in reqs], [req.prompt_len for req in reqs],
        prompt_logprobs if scoring else None,
    )  # fmt: skip
    launched = Launched(reqs, sampled, scored_only, with_drafts)
    if with_drafts:
        fb, launched.reqs = _with_drafts(fb, reqs)
    return fb, launched


def _with_drafts(fb: ForwardBatch, reqs: list[Req]) -> tuple[ForwardBatch, list[Req]]:
    """The batch with each request that has k drafts (a decode) as k + 1 one-token sequences of
    its row, at consecutive positions, each sampling: its last token, then its drafts (in the
    token table after it). All K/V of a layer is written before its attention runs, so each
    attends to the ones before it as one sequence would; and a batch of decodes keeps the shape
    CUDA graphs and the CPU's fused decode step run. Also returns the request of each sequence."""
    seqs = [(i, j) for i, req in enumerate(reqs) for j in range(1 + len(req.drafts))]

    def each(values: list[_T]) -> list[_T]:
        return [values[i] for i, _ in seqs]

    scores = None if fb.prompt_logprobs is None else each(fb.prompt_logprobs)
    flat = ForwardBatch(
        each(fb.table_rows), [fb.prefix_lens[i] + j for i, j in seqs], each(fb.extend_lens),
        each(fb.sampling), each(fb.seeds), each(fb.prompt_lens), scores,
    )  # fmt: skip
    return flat, each(reqs)
