"""The scheduler: admission, chunked prefill mixed with decode, retraction, and the overlap loop.

`step()` is nano-vllm's three beats: schedule a batch, run it, process results. With overlap on,
batch N+1 is scheduled and launched (on a worker thread) before batch N's results are processed,
so host-side scheduling hides behind the forward. Requests that finish in batch N may still be
in batch N+1: their extra token is dropped and their pages and table row are released only after
N+1 completes, so nothing in flight ever reads a row or page that was handed to someone else.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from minisgl.config import (
    DEFAULT_CPU_MAX_PREFILL_TOKENS,
    DEFAULT_CUDA_MAX_PREFILL_TOKENS,
    ServerArgs,
)
from minisgl.core import SEED_MASK, FinishReason, Req, ReqOutput, SamplingParams
from minisgl.engine.engine import Engine, ForwardBatch, ForwardOutput
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.stats import SchedulerHistograms, SchedulerStats

logger = logging.getLogger(__name__)

# Two prompts agreeing on this many leading tokens are taken to share a prefix worth caching.
SHARED_PREFIX_PROBE_LEN = 32


@dataclass
class _Launched:
    reqs: list[Req]
    sampled: list[Req]  # the requests that sample a token in this batch, in output order
    future: Future[ForwardOutput]
    release_after: list[Req] = field(default_factory=list)


class _NeedDrain(Exception):
    """Scheduling must see the in-flight batch's results first (retraction)."""


class Scheduler:
    def __init__(self, args: ServerArgs, engine: Engine | None = None) -> None:
        self.args = args
        self.engine = engine or Engine(args)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = self.engine.model_config.eos_token_ids
        self.page_size = args.page_size
        self.max_prefill_tokens = args.max_prefill_tokens or (
            DEFAULT_CUDA_MAX_PREFILL_TOKENS
            if self.engine.device.type == "cuda"
            else DEFAULT_CPU_MAX_PREFILL_TOKENS
        )
        self.cache = CacheManager(
            self.engine.num_pages,
            self.page_size,
            args.cache_type,
            self.engine.page_table,
            self.engine.token_table,
        )
        self.overlap = args.overlap_scheduling
        self._executor = ThreadPoolExecutor(1, "minisgl-forward") if self.overlap else None
        self._rng = random.Random(args.seed)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order
        self._inflight: _Launched | None = None
        self._outputs: list[ReqOutput] = []
        self._counters = dict.fromkeys(
            ("prompt", "generation", "cached", "prefill", "retractions", "aborted"), 0
        )
        self._histograms = SchedulerHistograms()

    # ---- requests in ---------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise ValueError for a request that could never run: checked before queueing."""
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        total = req.prompt_len + req.sampling_params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) plus max_tokens "
                f"({req.sampling_params.max_tokens}) is {total}, over the context length "
                f"{self.max_model_len}"
            )
        capacity = self.cache.num_total_pages * self.page_size
        if total > capacity:
            raise ValueError(
                f"prompt plus max_tokens ({total} tokens) exceeds the KV cache ({capacity} tokens)"
            )

    def add_request(self, req: Req) -> None:
        self.validate(req)
        req.seed = (
            req.sampling_params.seed
            if req.sampling_params.seed is not None
            else self._rng.getrandbits(31)
        ) & SEED_MASK
        if not req.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        self.waiting.append(req)

    def abort_request(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return
        for req in self.running:
            if req.rid == rid and not req.finished:
                self._finish(req, FinishReason.ABORT)
                self._release(req)
                return

    # ---- the loop ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight or self._outputs)

    def step(self) -> list[ReqOutput]:
        batch = self._schedule()
        previous, self._inflight = self._inflight, None
        if batch is not None:
            fb, reqs, sampled = batch
            if self._executor is not None:
                future = self._executor.submit(self.engine.forward, fb)
                self._inflight = _Launched(reqs, sampled, future)
            else:
                done: Future[ForwardOutput] = Future()
                done.set_result(self.engine.forward(fb))
                self._process(_Launched(reqs, sampled, done))
        if previous is not None:
            self._process(previous)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _drain(self) -> None:
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._process(launched)

    # ---- scheduling ----------------------------------------------------------------------------

    def _schedule(self) -> tuple[ForwardBatch, list[Req], list[Req]] | None:
        while True:
            try:
                return self._try_schedule()
            except _NeedDrain:
                self._drain()

    def _try_schedule(self) -> tuple[ForwardBatch, list[Req], list[Req]] | None:
        items: list[tuple[Req, int]] = []  # (request, tokens to compute this step)
        # 1. decodes first: one token each, latency matters most
        for req in self._decodable():
            if req.table_row < 0:  # retracted while making room for an older request
                continue
            while not self.cache.reserve(req, req.device_len):
                self._retract_one()
                if req.table_row < 0:  # it was the newest and got retracted itself
                    break
            else:
                items.append((req, 1))
        # 2. chunked prefills already under way, then 3. new requests, within the token budget
        budget = self.max_prefill_tokens
        for req in self.running:
            if budget <= 0:
                break
            if req.finished or req.remaining_prefill_len <= 1:
                continue
            chunk = min(req.remaining_prefill_len, budget)
            if not self.cache.reserve(req, req.cached_len + chunk):
                break
            items.append((req, chunk))
            budget -= chunk
        # Requests whose prompt starts like one admitted in this same step wait one step: by then
        # the first one's prefix is in the radix tree and they compute only their own suffix.
        admitted_keys: set[tuple[int, ...]] = set()
        deferred: list[Req] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if not self._can_admit(req):
                break
            self.waiting.popleft()
            key = self._prefix_key(req)
            if key is not None and key in admitted_keys:
                deferred.append(req)
                continue
            self.cache.admit(req)
            if key is not None and req.cached_len < len(key):
                admitted_keys.add(key)
            self.running.append(req)
            chunk = min(req.remaining_prefill_len, budget)
            if not self.cache.reserve(req, req.cached_len + chunk):
                # The estimate was optimistic (its cached prefix got locked): undo, retry later.
                self.running.pop()
                self.cache.release(req)
                self.waiting.appendleft(req)
                break
            if req.num_retractions == 0 and req.num_sampled == 0:
                req.num_cached_prompt_tokens = req.cached_len
                self._counters["cached"] += req.cached_len
                self._counters["prompt"] += req.prompt_len
                if req.arrival_time > 0:  # set by the server; offline requests have none
                    self._histograms.queue_time_s.observe(time.monotonic() - req.arrival_time)
            items.append((req, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(deferred))
        if not items:
            return None
        batch = self._build_batch(items)
        self._histograms.observe_step(len(items), sum(num_tokens for _, num_tokens in items))
        for req, num_tokens in items:
            if num_tokens > 1:  # a prefill chunk: share its prefix right away
                self.cache.cache_prefix(req)
        return batch

    def _prefix_key(self, req: Req) -> tuple[int, ...] | None:
        """The first tokens of a prompt, to spot requests sharing a prefix in one step."""
        if self.args.cache_type != "radix" or req.prompt_len <= SHARED_PREFIX_PROBE_LEN:
            return None
        return tuple(req.input_ids[:SHARED_PREFIX_PROBE_LEN])

    def _decodable(self) -> list[Req]:
        return [
            r
            for r in self.running
            if not r.finished
            and r.remaining_prefill_len == 1
            and r.num_sampled < r.sampling_params.max_tokens
        ]

    def _can_admit(self, req: Req) -> bool:
        if len(self.running) >= self.args.max_running_requests or not self.cache.free_rows:
            return False
        # Optimistic admission: the first chunk's pages plus one page of headroom per running
        # request, not the whole max_tokens (retraction handles the rare overflow).
        need_tokens = min(req.prompt_len + len(req.output_ids), self.max_prefill_tokens)
        need_pages = -(-need_tokens // self.page_size) + len(self.running)
        return self.cache.num_available_pages >= need_pages or not self.running

    def _build_batch(
        self, items: list[tuple[Req, int]]
    ) -> tuple[ForwardBatch, list[Req], list[Req]]:
        reqs: list[Req] = []
        sampled: list[Req] = []
        sampling: list[SamplingParams | None] = []
        rows, prefix_lens, extend_lens, seeds, prompt_lens = [], [], [], [], []
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
            if req.cached_len == req.device_len:  # reached the end: sample the next token
                sampling.append(req.sampling_params)
                sampled.append(req)
                req.device_len += 1
                req.num_sampled += 1
            else:
                sampling.append(None)
        fb = ForwardBatch(rows, prefix_lens, extend_lens, sampling, seeds, prompt_lens)
        return fb, reqs, sampled

    def _retract_one(self) -> None:
        """Free the newest running request's KV and send it back to the queue front."""
        if self._inflight is not None:
            raise _NeedDrain
        victim = self.running[-1]
        if len(self.running) == 1:
            raise RuntimeError("KV pool too small for a single request (admission let it in)")
        self.running.pop()
        self.cache.release(victim)
        victim.device_len = len(victim.all_ids)
        victim.num_retractions += 1
        self._counters["retractions"] += 1
        self.waiting.appendleft(victim)
        logger.debug("retracted %s at %d tokens", victim.rid, victim.device_len)

    # ---- results -------------------------------------------------------------------------------

    def _process(self, launched: _Launched) -> None:
        result = launched.future.result()
        for req, token_id, logprob in zip(
            launched.sampled, result.token_ids, result.logprobs, strict=True
        ):
            if req.finished:
                continue  # the one extra token after a finish under overlap: dropped
            req.output_ids.append(token_id)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            self._counters["generation"] += 1
            reason = self._finish_reason(req, token_id)
            self._outputs.append(
                ReqOutput(
                    req.rid,
                    (token_id,),
                    reason,
                    (logprob,) if logprob is not None else (),
                    req.prompt_len,
                    req.num_cached_prompt_tokens,
                )
            )
            if reason is not None:
                req.finish_reason = reason
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
        if reason == FinishReason.ABORT:
            self._counters["aborted"] += 1
        self._outputs.append(
            ReqOutput(req.rid, (), reason, (), req.prompt_len, req.num_cached_prompt_tokens)
        )

    def _release(self, req: Req) -> None:
        """Drop a finished request; its KV waits for the in-flight batch if that batch uses it."""
        self.running.remove(req)
        if self._inflight is not None and req in self._inflight.reqs:
            self._inflight.release_after.append(req)
        else:
            self.cache.release(req)

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        total = self.cache.num_total_pages
        c = self._counters
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_queue_reqs=len(self.waiting),
            kv_cache_usage_ratio=self.cache.num_used_pages / total,
            num_free_pages=self.cache.num_available_pages,
            num_total_pages=total,
            prompt_tokens_total=c["prompt"],
            generation_tokens_total=c["generation"],
            cached_prompt_tokens_total=c["cached"],
            prefill_tokens_total=c["prefill"],
            num_retractions_total=c["retractions"],
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
