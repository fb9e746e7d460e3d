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
    decodes: list[Req], chunks: list[tuple[Req, int]], with_drafts: bool = False
) -> tuple[ForwardBatch, Launched]:
    """Advance each request by its tokens (a decode by one, a prefill chunk by its own;
    `cached_len`, and `device_len` by the token it will sample) and describe the work for the
    engine. `with_drafts`: some decodes have drafts (speculative decoding); they advance by those
    verified, when the results are in. Runs every step: the decodes in bulk, no tuple each."""
    reqs = decodes + [req for req, _ in chunks]
    prefix_lens = [req.cached_len for req in reqs]
    # scores_prompt, with the usual case (no prompt logprobs wanted) first
    prompt_logprobs = [r.sampling_params.prompt_logprobs for r in reqs]
    scoring = prompt_logprobs.count(None) != len(reqs)
    if scoring:
        scored = zip(prompt_logprobs, reqs, strict=True)
        prompt_logprobs = [k if r.scores_prompt else None for k, r in scored]
    sampling: list[SamplingParams | None] = [req.sampling_params for req in decodes]
    for req in decodes:  # each samples (DecodeManager schedules none past max_tokens)
        req.cached_len += 1
        req.device_len += 1
        req.num_sampled += 1
    sampled = decodes.copy()
    scored_only: list[Req] = []  # max_tokens 0: the prompt ends here, nothing to sample
    for req, num_tokens in chunks:
        req.cached_len += num_tokens
        params = req.sampling_params
        if req.cached_len != req.device_len:  # short of the prompt's end
            sampling.append(None)
        elif params.max_tokens > 0:  # sample the next token
            sampling.append(params)
            sampled.append(req)
            req.device_len += 1
            req.num_sampled += 1
        else:
            sampling.append(None)
            scored_only.append(req)
    extend_lens = [1] * len(decodes) + [n for _, n in chunks]
    fb = ForwardBatch(
        [req.table_row for req in reqs], prefix_lens, extend_lens, sampling,
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
