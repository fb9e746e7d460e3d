"""The scheduler: one step = schedule a batch, launch it, process results (nano-vllm's beats).

The parts: `PrefillManager` (queue, admission, prompt chunks), `DecodeManager` (running
requests, retraction), `CacheManager` (KV pages, the prefix cache and table rows),
`OverlapLoop` (the batch in flight, the forward thread, deferred releases), `GrammarMasks`
(structured outputs), `Outputs` (events and live requests), `SchedulerCounters` (for
/metrics) and `fail_admitted` (failure recovery). This class composes them: requests in,
scheduling a step's batch, and its results into the requests.
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from minisgl.config import ServerArgs
from minisgl.core import SEED_MASK, FinishReason, Req, ReqOutput, TokenLogprob
from minisgl.engine.batch import ForwardBatch
from minisgl.engine.device import nvtx_range
from minisgl.engine.engine import Engine
from minisgl.limits import ModelLimits, check_request
from minisgl.scheduler.batch import Launched, build_batch
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.counters import SchedulerCounters
from minisgl.scheduler.decode import DecodeManager, NeedDrain
from minisgl.scheduler.grammar_masks import GrammarMasks
from minisgl.scheduler.outputs import Outputs
from minisgl.scheduler.overlap import OverlapLoop
from minisgl.scheduler.policy import OUTPUT_TOKEN_WEIGHT
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.recovery import fail_admitted
from minisgl.scheduler.speculative import NgramSpeculator
from minisgl.stats import SchedulerStats


class Scheduler:
    def __init__(self, args: ServerArgs, engine: Engine | None = None) -> None:
        self.args = args
        self.engine = engine or Engine(args)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = self.engine.model_config.eos_token_ids
        self.page_size = args.page_size
        self.cache = CacheManager(
            self.engine.num_pages, self.page_size, args.cache_type, self.engine.tables
        )
        self.prefill = PrefillManager(self.cache, args, self.engine.max_prefill_tokens)
        self.counters = SchedulerCounters()
        self.speculator = None
        if args.speculative_algorithm is not None:
            self.speculator = NgramSpeculator(args, self.cache, self.counters, self.max_model_len)
        self.decode = DecodeManager(self.cache, self.prefill, self.speculator)
        tokenizer_path = args.tokenizer or self.model_path
        self.masks = GrammarMasks(tokenizer_path, self.vocab_size, self.eos_token_ids)
        self.outputs = Outputs()
        overlap = args.overlap_enabled(self.engine.device.type)
        self.loop = OverlapLoop(self.engine, overlap, self.cache, self.masks, self._process)
        self._rng = random.Random(args.seed)
        self._is_cuda = self.engine.stream.is_cuda  # NVTX ranges there

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
        self.masks.compiled(req)  # a bad constraint fails here (cached for add_request)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        seed = req.sampling_params.seed
        req.seed = (self._rng.getrandbits(31) if seed is None else seed) & SEED_MASK
        if not req.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        self.masks.attach(req)
        self.prefill.add(req)
        self.outputs.live[req.rid] = req

    def abort_request(self, rid: str) -> None:
        if (waiting := self.prefill.remove(rid)) is not None:
            self.outputs.end(waiting, FinishReason.ABORT)
            return
        for req in self.running:
            if req.rid == rid and not req.finished:
                self.outputs.end(req, FinishReason.ABORT)
                self._release(req)
                return

    # ---- the loop ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.prefill.waiting or self.running or self.loop.inflight or self.outputs)

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        with nvtx_range("schedule", self._is_cuda):
            batch = self._schedule()
        self.loop.run(batch)
        return self.outputs.take()

    def _schedule(self) -> tuple[ForwardBatch, Launched] | None:
        while True:
            try:
                decodes = self.decode.schedule(inflight=self.loop.inflight is not None)
                break
            except NeedDrain:
                self.loop.drain()
        plan = self.prefill.schedule(self.running)
        for req in plan.admitted:
            if req.num_retractions == 0 and req.num_sampled == 0:
                req.num_cached_prompt_tokens = req.cached_len
                self.counters.first_admission(req)
        if not decodes and not plan.items:
            return None
        num_drafts = sum(len(req.drafts) for req in decodes) if self.speculator is not None else 0
        self.counters.step(len(decodes), plan.items, num_drafts)
        batch = build_batch(decodes, plan.items, with_drafts=num_drafts > 0)
        for req, num_tokens in plan.items:
            if num_tokens > 1:  # a prefill chunk: share its prefix right away
                self.cache.cache_prefix(req)
        return batch

    def _process(self, launched: Launched) -> None:
        """A launched batch's results into its requests (its tokens, finishes and releases)."""
        result = launched.result()
        with nvtx_range("process", self._is_cuda):
            for index, scored in result.prompt_logprobs.items():
                launched.reqs[index].prompt_logprobs.extend(scored)
            for req in launched.scored_only:
                if not req.finished:
                    self.outputs.end(req, FinishReason.LENGTH)
                    self._release(req)
            if self.speculator is not None and launched.with_drafts:
                rows = zip(result.token_ids, result.logprobs, strict=True)
                for req in launched.sampled:
                    self.speculator.verify(req, rows, self._take)
            else:
                self._take(launched.sampled, result.token_ids, result.logprobs)
            for req in launched.release_after:
                self.cache.release(req)

    def _take(
        self, reqs: list[Req], token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> None:
        """Sampled tokens into their requests (output, grammar, events), token_ids[i] into
        reqs[i], in order; a request they end is released, and takes no more. One loop over a
        step's tokens, on locals: this is the host's largest cost per running request."""
        events, max_model_len = self.outputs.events, self.max_model_len
        policy = self.prefill.policy  # charges output tokens to tenants under fairness
        num_taken = 0
        for req, token_id, logprob in zip(reqs, token_ids, logprobs, strict=True):
            if req.finish_reason is not None:  # its extra token in the batch after (overlap)
                continue
            output_ids, params = req.output_ids, req.sampling_params
            output_ids.append(token_id)
            num_taken += 1
            if req.grammar is not None:
                req.grammar.accept(output_ids)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if policy.fairness:
                policy.charge(req, OUTPUT_TOKEN_WEIGHT)
            num_outputs = len(output_ids)
            reason = None
            if token_id in params.stop_token_ids or (
                token_id in req.eos_token_ids and not params.ignore_eos
            ):
                reason = FinishReason.STOP
            elif num_outputs >= params.max_tokens or req.prompt_len + num_outputs >= max_model_len:
                reason = FinishReason.LENGTH
            events.append(
                ReqOutput(
                    req.rid, (token_id,), reason, () if logprob is None else (logprob,),
                    req.prompt_len, req.num_cached_prompt_tokens,
                    tuple(req.prompt_logprobs) if num_outputs == 1 else (),
                )
            )  # fmt: skip
            if reason is not None:
                req.finish_reason, req.grammar = reason, None
                self._release(req)
        self.counters.generation_tokens_total += num_taken

    def _release(self, req: Req) -> None:
        """Drop a finished request; its KV waits for the in-flight batch if that batch uses it."""
        self.running.remove(req)
        self.loop.release(req)

    def fail_running(self, error: str) -> list[ReqOutput]:
        """After `step()` raised: end every admitted request with `error` and start over from a
        known state (scheduler/recovery.py). Raises when the state cannot be trusted: a device
        error (CUDA's are sticky) or pages that do not add up."""
        fail_admitted(self, error)
        self.check_page_accounting()
        return self.outputs.take()

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        total = self.cache.num_total_pages
        verifies = self.counters.spec_verify_steps_total
        accepted = self.counters.spec_accepted_tokens_total
        return SchedulerStats(
            spec_accept_length=(accepted + verifies) / verifies if verifies else 0.0,
            num_running_reqs=len(self.running),
            num_queue_reqs=len(self.prefill.waiting),
            num_queue_reqs_by_priority=dict(
                Counter(str(r.sampling_params.priority) for r in self.prefill.waiting)
            ),
            kv_cache_usage_ratio=self.cache.num_used_pages / total,
            num_free_pages=self.cache.num_available_pages,
            num_total_pages=total,
            num_retractions_total=self.decode.num_retractions,
            **self.counters.snapshot(),
        )

    def check_health(self) -> None:
        """Single process: nothing can die behind our back (TPScheduler checks its ranks)."""

    def check_page_accounting(self) -> None:
        self.cache.check_page_accounting([*self.running, *self.loop.deferred_releases])

    def flush_cache(self) -> None:
        if self.running or self.loop.inflight:
            raise RuntimeError("flush_cache needs an idle scheduler")
        self.cache.flush()

    def shutdown(self) -> None:
        self.loop.shutdown()
