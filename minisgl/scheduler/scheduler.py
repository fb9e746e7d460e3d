"""The scheduler: one step = schedule a batch, launch it, process results (nano-vllm's beats).

The parts: `PrefillManager` (queue, admission, prompt chunks), `DecodeManager` (running
requests, retraction), `CacheManager` (KV pages and the prefix cache), `TableManager` (table
rows). This class composes them and owns the overlap loop.

Overlap: batch N+1 is scheduled and launched before batch N's results are processed, so
host-side scheduling hides behind the forward. On CUDA "launched" means queued on the engine's
stream (nothing waits until N's results are read); on CPU, where overlap is opt-in, the forward
runs on a worker thread. Requests that finish in batch N may still be in batch N+1: their extra
token is dropped and their pages and table row are released only after N+1 completes, so
nothing in flight ever reads a row or page that was handed to someone else.

Structured outputs: a constrained request's mask for batch N+1 depends on its token from batch
N. When that token is still in flight, the step launches N+1's forward, processes N (which
advances the grammars), then builds the mask and launches N+1's sampling (SGLang's order; see
docs/architecture.md, "Structured outputs").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from minisgl.config import ServerArgs
from minisgl.core import SEED_MASK, FinishReason, Req, ReqOutput, SamplingParams
from minisgl.engine.batch import ForwardBatch, ForwardOutput, PendingOutput, VocabMask
from minisgl.engine.device import nvtx_range
from minisgl.engine.engine import Engine
from minisgl.grammar import GrammarCompiler, GrammarState, build_vocab_mask
from minisgl.grammar.compiler import compiler_for_checkpoint
from minisgl.limits import ModelLimits, check_request
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.decode import DecodeManager, NeedDrain
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.stats import SchedulerHistograms, SchedulerStats
from minisgl.scheduler.table import TableManager

_T = TypeVar("_T")


def _resolved(value: _T | Future[_T]) -> _T:
    return value.result() if isinstance(value, Future) else value


@dataclass
class _Launched:
    reqs: list[Req]
    sampled: list[Req]  # the requests that sample a token in this batch, in output order
    pending: PendingOutput | Future[PendingOutput] | None = None  # set once sampling launched
    release_after: list[Req] = field(default_factory=list)
    # max_tokens 0 (prompt logprobs only): requests whose prompt this batch completes
    scored_only: list[Req] = field(default_factory=list)

    def result(self) -> ForwardOutput:
        pending = self.pending
        assert pending is not None
        if isinstance(pending, Future):
            pending = pending.result()
        return pending.result()


class Scheduler:
    def __init__(self, args: ServerArgs, engine: Engine | None = None) -> None:
        self.args = args
        self.engine = engine or Engine(args)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = self.engine.model_config.eos_token_ids
        self.page_size = args.page_size
        self.table = TableManager(self.engine.tables)
        self.cache = CacheManager(
            self.engine.num_pages, self.page_size, args.cache_type, self.table
        )
        self.prefill = PrefillManager(
            self.cache,
            self.page_size,
            self.engine.max_prefill_tokens,
            args.max_running_requests,
            share_prefixes=args.cache_type == "radix",
        )
        self.decode = DecodeManager(self.cache, self.prefill.requeue_front)
        self.overlap = args.overlap_enabled(self.engine.device.type)
        self._is_cuda = self.engine.dev.is_cuda  # NVTX ranges there
        # CPU overlap needs a thread to run the forward; CUDA launches are asynchronous anyway.
        self._executor = (
            ThreadPoolExecutor(1, "minisgl-forward")
            if self.overlap and not self.engine.dev.is_cuda
            else None
        )
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._rng = random.Random(args.seed)
        self._inflight: _Launched | None = None
        self._outputs: list[ReqOutput] = []
        # Every request added and not yet ended, by rid: after a failed step, any of them that is
        # neither waiting nor running (caught between the two) still gets its one terminal event.
        self._live: dict[str, Req] = {}
        self._counters = dict.fromkeys(("prompt", "generation", "cached", "prefill", "aborted"), 0)
        self._histograms = SchedulerHistograms()

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def waiting(self) -> list[Req]:
        return list(self.prefill.waiting)

    # ---- requests in ---------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise ValueError for a request that could never run: checked before queueing."""
        capacity_tokens = self.cache.num_total_pages * self.page_size
        limits = ModelLimits(self.max_model_len, self.vocab_size, capacity_tokens)
        check_request(req.input_ids, req.sampling_params, limits)
        self._compiled_grammar(req)  # a bad constraint fails here (cached for add_request)

    def _compiled_grammar(self, req: Req) -> Any:
        constraint = req.sampling_params.constraint
        if constraint is None:
            return None
        if self._grammars is None:
            # Once per process: reads the tokenizer's vocabulary (~0.5-1.5 s).
            tokenizer_path = self.args.tokenizer or self.model_path
            self._grammars = compiler_for_checkpoint(
                tokenizer_path, self.vocab_size, self.eos_token_ids
            )
        return self._grammars.load(constraint, req.grammar_blob)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        req.seed = (
            req.sampling_params.seed
            if req.sampling_params.seed is not None
            else self._rng.getrandbits(31)
        ) & SEED_MASK
        if not req.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        compiled = self._compiled_grammar(req)
        if compiled is not None:
            assert req.sampling_params.constraint is not None
            req.grammar = GrammarState(compiled, req.sampling_params.constraint.start_after)
            req.grammar_blob = None  # loaded: the serialized copy is not needed any more
        self.prefill.add(req)
        self._live[req.rid] = req

    def abort_request(self, rid: str) -> None:
        waiting = self.prefill.remove(rid)
        if waiting is not None:
            self._finish(waiting, FinishReason.ABORT)
            return
        for req in self.running:
            if req.rid == rid and not req.finished:
                self._finish(req, FinishReason.ABORT)
                self._release(req)
                return

    # ---- the loop ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.prefill.waiting or self.running or self._inflight or self._outputs)

    def step(self) -> list[ReqOutput]:
        with nvtx_range("schedule", self._is_cuda):
            batch = self._schedule()
        previous, self._inflight = self._inflight, None
        if batch is not None:
            fb, launched = batch
            sampled = launched.sampled
            if self.overlap:
                self._inflight = launched  # before processing `previous`: its releases wait
            if previous is not None and self._mask_needs(previous, sampled):
                logits = self._submit(self.engine.forward_logits, fb)
                self._process(previous)  # advances the grammars by batch N's tokens
                previous = None
                launched.pending = self._submit(self._sample, fb, logits, self._mask(sampled))
            else:
                launched.pending = self._submit(self.engine.forward, fb, self._mask(sampled))
            if not self.overlap:
                self._process(launched)
        if previous is not None:
            self._process(previous)
        return self._take_outputs()

    def _take_outputs(self) -> list[ReqOutput]:
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            if out.finish_reason is not None:
                self._live.pop(out.rid, None)
        return outputs

    def _submit(self, fn: Callable[..., _T], *args: Any) -> _T | Future[_T]:
        """Run on the forward thread (CPU overlap: tasks run in submission order) or here."""
        if self._executor is not None:
            return self._executor.submit(fn, *args)
        return fn(*args)

    def _sample(self, fb: ForwardBatch, logits: Any, vocab_mask: VocabMask | None) -> PendingOutput:
        return self.engine.sample(fb, _resolved(logits), vocab_mask)

    @staticmethod
    def _mask_needs(previous: _Launched, sampled: list[Req]) -> bool:
        """Whether a constrained request of this batch has its previous token in flight."""
        in_flight = {id(r) for r in previous.sampled if r.grammar is not None}
        return any(id(r) in in_flight for r in sampled if r.grammar is not None)

    def _mask(self, sampled: list[Req]) -> VocabMask | None:
        states = [None if r.finished else r.grammar for r in sampled]
        return build_vocab_mask(states, self.vocab_size)

    def _drain(self) -> None:
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._process(launched)

    # ---- scheduling ----------------------------------------------------------------------------

    def _schedule(self) -> tuple[ForwardBatch, _Launched] | None:
        while True:
            try:
                items = self.decode.schedule(inflight=self._inflight is not None)
                break
            except NeedDrain:
                self._drain()
        plan = self.prefill.schedule(self.running)
        for req in plan.admitted:
            if req.num_retractions == 0 and req.num_sampled == 0:
                req.num_cached_prompt_tokens = req.cached_len
                self._counters["cached"] += req.cached_len
                self._counters["prompt"] += req.prompt_len
                if req.arrival_time > 0:  # set by the server; offline requests have none
                    self._histograms.queue_time_s.observe(time.monotonic() - req.arrival_time)
        items += plan.items
        if not items:
            return None
        batch = self._build_batch(items)
        self._histograms.observe_step(len(items), sum(num_tokens for _, num_tokens in items))
        for req, num_tokens in items:
            if num_tokens > 1:  # a prefill chunk: share its prefix right away
                self.cache.cache_prefix(req)
        return batch

    def _build_batch(self, items: list[tuple[Req, int]]) -> tuple[ForwardBatch, _Launched]:
        reqs: list[Req] = []
        sampled: list[Req] = []
        scored_only: list[Req] = []  # max_tokens 0: the prompt ends here, nothing to sample
        sampling: list[SamplingParams | None] = []
        rows, prefix_lens, extend_lens, seeds, prompt_lens = [], [], [], [], []
        prompt_logprobs = [
            req.sampling_params.prompt_logprobs if req.scores_prompt else None for req, _ in items
        ]
        for req, num_tokens in items:
            reqs.append(req)
            rows.append(req.table_row)
            prefix_lens.append(req.cached_len)
            extend_lens.append(num_tokens)
            seeds.append(req.seed)
            prompt_lens.append(req.prompt_len)
            # prompt tokens actually computed (cache hits never get here)
            self._counters["prefill"] += max(0, min(req.prompt_len - req.cached_len, num_tokens))
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
            rows, prefix_lens, extend_lens, sampling, seeds, prompt_lens,
            prompt_logprobs if scoring else None,
        )  # fmt: skip
        return fb, _Launched(reqs, sampled, scored_only=scored_only)

    # ---- results -------------------------------------------------------------------------------

    def _process(self, launched: _Launched) -> None:
        result = launched.result()
        with nvtx_range("process", self._is_cuda):
            for index, scored in result.prompt_logprobs.items():
                launched.reqs[index].prompt_logprobs.extend(scored)
            for req in launched.scored_only:
                if not req.finished:
                    self._finish(req, FinishReason.LENGTH)
                    self._release(req)
            for req, token_id, logprob in zip(
                launched.sampled, result.token_ids, result.logprobs, strict=True
            ):
                if req.finished:
                    continue  # the one extra token after a finish under overlap: dropped
                req.output_ids.append(token_id)
                if req.grammar is not None:
                    req.grammar.accept(req.output_ids)
                if logprob is not None:
                    req.output_logprobs.append(logprob)
                self._counters["generation"] += 1
                reason = self._finish_reason(req, token_id)
                first = len(req.output_ids) == 1
                self._outputs.append(
                    ReqOutput(
                        req.rid,
                        (token_id,),
                        reason,
                        (logprob,) if logprob is not None else (),
                        req.prompt_len,
                        req.num_cached_prompt_tokens,
                        prompt_logprobs=tuple(req.prompt_logprobs) if first else (),
                    )
                )
                if reason is not None:
                    req.finish_reason = reason
                    req.grammar = None
                    self._release(req)
            for req in launched.release_after:
                self.cache.release(req)

    def _finish_reason(self, req: Req, token_id: int) -> FinishReason | None:
        params = req.sampling_params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in req.eos_token_ids
        ):
            return FinishReason.STOP
        num_outputs = len(req.output_ids)
        if num_outputs >= params.max_tokens or req.prompt_len + num_outputs >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.grammar = None
        if reason == FinishReason.ABORT:
            self._counters["aborted"] += 1
        # A request that only scored its prompt (max_tokens 0) ends here with its logprobs.
        only_scored = reason == FinishReason.LENGTH and not req.output_ids
        scored = tuple(req.prompt_logprobs) if only_scored else ()
        self._outputs.append(
            ReqOutput(
                req.rid, (), reason, (), req.prompt_len, req.num_cached_prompt_tokens,
                prompt_logprobs=scored,
            )
        )  # fmt: skip

    def _release(self, req: Req) -> None:
        """Drop a finished request; its KV waits for the in-flight batch if that batch uses it."""
        self.running.remove(req)
        if self._inflight is not None and req in self._inflight.reqs:
            self._inflight.release_after.append(req)
        else:
            self.cache.release(req)

    def fail_running(self, error: str) -> list[ReqOutput]:
        """After `step()` raised: end every admitted request with `error` and start over from a
        known state, so one bad batch does not take the server down. Requests still waiting
        keep their place. The prefix cache is emptied: the failed batch may have left pages
        shared in it (a prefill chunk's) without their KV. Raises when the state cannot be
        trusted: a device error (CUDA's are sticky) or pages that do not add up."""
        launched, self._inflight = self._inflight, None
        if self._executor is not None:
            # No forward may still write KV into pages given back below. The thread runs tasks
            # in submission order: once this no-op has run, every earlier batch is done.
            self._executor.submit(lambda: None).result()
        self.engine.dev.synchronize()
        # What finished before the failure stands; then every live request that is not waiting
        # fails: the running ones, and any the failure caught between the queue and the batch.
        ended = {out.rid for out in self._outputs if out.finish_reason is not None}
        waiting = {id(req) for req in self.prefill.waiting}
        for req in list(self._live.values()):
            if id(req) in waiting or req.rid in ended:
                continue
            if not req.finished:
                req.finish_reason, req.grammar = FinishReason.ERROR, None
                self._outputs.append(
                    ReqOutput(
                        req.rid, (), FinishReason.ERROR, (), req.prompt_len,
                        req.num_cached_prompt_tokens, error=error, internal_error=True,
                    )
                )  # fmt: skip
            if req in self.running:
                self.running.remove(req)
            if req.table_row >= 0:  # it holds a row and pages
                self.cache.discard(req)
        for req in launched.release_after if launched is not None else ():
            self.cache.discard(req)
        self.cache.flush()
        self.check_page_accounting()
        return self._take_outputs()

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        total = self.cache.num_total_pages
        c = self._counters
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_queue_reqs=len(self.prefill.waiting),
            kv_cache_usage_ratio=self.cache.num_used_pages / total,
            num_free_pages=self.cache.num_available_pages,
            num_total_pages=total,
            prompt_tokens_total=c["prompt"],
            generation_tokens_total=c["generation"],
            cached_prompt_tokens_total=c["cached"],
            prefill_tokens_total=c["prefill"],
            num_retractions_total=self.decode.num_retractions,
            aborted_requests_total=c["aborted"],
            queue_time_s=self._histograms.queue_time_s.snapshot(),
            batch_size=self._histograms.batch_size.snapshot(),
            batch_tokens=self._histograms.batch_tokens.snapshot(),
        )

    def check_health(self) -> None:
        """Single process: nothing can die behind our back (TPScheduler checks its ranks)."""

    def check_page_accounting(self) -> None:
        live = list(self.running)
        if self._inflight is not None:
            live += self._inflight.release_after
        self.cache.check_page_accounting(live)

    def flush_cache(self) -> None:
        if self.running or self._inflight:
            raise RuntimeError("flush_cache needs an idle scheduler")
        self.cache.flush()

    def shutdown(self) -> None:
        self._drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
