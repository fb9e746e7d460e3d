"""One step's batch: the scheduled requests become the engine's `ForwardBatch` (which carries the
scheduler's bookkeeping too), and the thread its forward runs on."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from minisgl.core import Req, SamplingParams
from minisgl.engine.batch import ForwardBatch

_T = TypeVar("_T")


def resolved(value: _T | Future[_T]) -> _T:
    """A value computed here, or one the forward thread computes (CPU overlap)."""
    return value.result() if isinstance(value, Future) else value


class ForwardThread:
    """Where a batch's forward runs: on one worker thread under CPU overlap, so that the host
    schedules the next batch meanwhile (tasks run in submission order), else right here (a CUDA
    launch returns at once anyway)."""

    def __init__(self, threaded: bool) -> None:
        self._executor = ThreadPoolExecutor(1, "minisgl-forward") if threaded else None

    def submit(self, fn: Callable[..., _T], *args: Any) -> _T | Future[_T]:
        return fn(*args) if self._executor is None else self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def build_batch(
    decodes: list[Req], chunks: list[tuple[Req, int]], with_drafts: bool = False
) -> ForwardBatch:
    """Advance each request by its tokens (a decode by one, a prefill chunk by its own;
    `cached_len`, and `device_len` by the token it will sample) and describe the work for the
    engine. `with_drafts`: a decode with k drafts (speculative decoding) is k + 1 one-token
    sequences of its row, each sampling: its last token, then its drafts (in the token table
    after it); it advances by those verified, when the results are in."""
    # Runs every step: the decodes in bulk, no tuple each. Draft sequences sit at consecutive
    # positions: all K/V of a layer is written before its attention runs, so each attends to
    # the ones before it as one sequence would, and a batch of decodes keeps the shape CUDA
    # graphs and the CPU's fused decode step run.
    decode_seqs, prefix_lens = decodes, [req.cached_len for req in decodes]
    if with_drafts:
        decode_seqs = [req for req in decodes for _ in range(1 + len(req.drafts))]
        prefix_lens = [req.cached_len + j for req in decodes for j in range(1 + len(req.drafts))]
    reqs = decode_seqs + [req for req, _ in chunks]
    prefix_lens += [req.cached_len for req, _ in chunks]
    wanted = [r.sampling_params.prompt_logprobs for r in reqs]
    prompt_logprobs: list[int | None] | None = None  # the usual case: no prompt scored
    if wanted.count(None) != len(reqs):
        prompt_logprobs = [
            k if r.scores_prompt else None for k, r in zip(wanted, reqs, strict=True)
        ]
    sampling: list[SamplingParams | None] = [req.sampling_params for req in decode_seqs]
    for req in decodes:  # each samples (DecodeManager schedules none past max_tokens)
        req.cached_len += 1
        req.device_len += 1
    scored_only: list[Req] = []  # max_tokens 0: the prompt ends here, nothing to sample
    pooled: dict[int, range] = {}  # embeddings (decodes never pool)
    for seq, (req, num_tokens) in enumerate(chunks, len(decode_seqs)):
        params = req.sampling_params
        if params.pooling is not None:  # its positions in this chunk that pool (if any)
            end = req.cached_len + num_tokens
            if chunk := params.pooling.positions(req.prompt_len, req.cached_len, end):
                pooled[seq] = chunk
        req.cached_len += num_tokens
        if req.cached_len != req.device_len:  # short of the prompt's end
            sampling.append(None)
        elif params.max_tokens > 0:  # sample the next token
            sampling.append(params)
            req.device_len += 1
        else:
            sampling.append(None)
            scored_only.append(req)
    return ForwardBatch(
        [req.table_row for req in reqs],
        prefix_lens,
        [1] * len(decode_seqs) + [n for _, n in chunks],
        sampling,
        [req.seed for req in reqs],
        [req.prompt_len for req in reqs],
        prompt_logprobs,
        reqs,
        scored_only,
        with_drafts,
        pooled_positions=pooled,
    )
