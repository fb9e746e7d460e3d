"""The scheduler: one step = schedule a batch, launch it, process the previous batch's results.

This class owns the running requests and the batch in flight, and composes the managers that
docs/architecture.md#modules-each-imports-only-the-ones-above-it lists. Calls made between steps
wait in its inbox, which the next step applies first, on every tp rank alike
(minisgl.scheduler.tp)."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from minisgl.config import ServerArgs
from minisgl.core import SEED_MASK, FinishReason, Req, ReqOutput, TokenLogprob, finish_reason
from minisgl.engine.batch import ForwardBatch, embedding_bytes
from minisgl.engine.device import nvtx_range
from minisgl.engine.engine import Engine
from minisgl.limits import ModelLimits, check_request
from minisgl.runtime.messages import AbortRequest, FlushCacheRequest
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.counters import SchedulerCounters
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.forward import ForwardThread, build_batch, resolved
from minisgl.scheduler.grammar_masks import GrammarMasks
from minisgl.scheduler.policy import OUTPUT_TOKEN_WEIGHT
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.speculative import NgramSpeculator
from minisgl.scheduler.step_cost import ChunkCosts, StepCosts
from minisgl.stats import SchedulerStats

if TYPE_CHECKING:
    from minisgl.scheduler.tp import TPGroup

logger = logging.getLogger(__name__)

# A call made between steps, in the order made: a request to add, one to abort, a cache flush;
# last, the step's chunk costs (rank 0's: every tp rank sizes the same chunks).
Inbox = list[Req | AbortRequest | FlushCacheRequest | ChunkCosts]


class Scheduler:
    def __init__(
        self, args: ServerArgs, engine: Engine | None = None, tp: TPGroup | None = None
    ) -> None:
        self.args = args
        self.tp = tp  # rank 0 of a tp group: each step's inbox goes to every rank
        self.engine = engine = engine or Engine(args)
        self.eos_token_ids = engine.model_config.eos_token_ids
        vocab_size = engine.model_config.vocab_size
        kv_capacity_tokens = engine.num_pages * args.page_size
        self.limits = ModelLimits(engine.max_model_len, vocab_size, kv_capacity_tokens)
        self.cache = CacheManager(engine.num_pages, args.page_size, args.cache_type, engine.tables)
        self.prefill = PrefillManager(self.cache, args, engine.max_prefill_tokens)
        self.counters = SchedulerCounters()
        self.step_costs = StepCosts(args.target_itl_ms)
        self.chunk_costs = ChunkCosts()  # this step's
        self.speculator = None
        if args.speculative_algorithm is not None:
            self.speculator = NgramSpeculator(args, self.cache, self.counters, engine.max_model_len)
        self.decode = DecodeManager(self.cache, self.prefill, self.speculator)
        tokenizer_path = args.tokenizer or str(engine.model_path)
        self.masks = GrammarMasks(tokenizer_path, vocab_size, self.eos_token_ids)
        self.overlap = args.overlap_enabled(engine.device.type)
        self._is_cuda = engine.stream.is_cuda  # NVTX ranges there; CUDA launches return at once
        self.forward_thread = ForwardThread(self.overlap and not self._is_cuda)
        self.running: list[Req] = []  # admitted, in admission order
        self.inflight: ForwardBatch | None = None  # launched, results not processed (overlap)
        self.events: list[ReqOutput] = []  # this step's: one per new token, one terminal each
        # Every request added and not ended, by rid: after a failed step, any of them that is
        # neither waiting nor running (caught between the two) still gets its terminal event.
        self.live: dict[str, Req] = {}
        self._inbox: Inbox = []
        self._rng = random.Random(args.seed)

    # ---- calls between steps: queued, applied at the next step --------------------------------

    def add_request(self, *reqs: Req) -> None:
        """Queue requests for the next step: all of them, or none (ValueError) if one could never
        run. A bad constraint fails here too (compiled once, cached for the step's attach)."""
        for req in reqs:
            check_request(req.input_ids, req.sampling_params, self.limits)
            self.masks.compiled(req)
        self._inbox += reqs

    def abort_request(self, rid: str) -> None:
        self._inbox.append(AbortRequest(rid))

    def flush_cache(self) -> None:
        """Empty the prefix cache, on every rank (only while idle: cached pages may be in use)."""
        if self.has_work():
            raise RuntimeError("flush_cache needs an idle scheduler")
        self._inbox.append(FlushCacheRequest(-1))
        self.step()

    def _apply(self, inbox: Inbox | None) -> None:
        """The calls made since the last step (a tp follower's: rank 0's, as broadcast)."""
        if inbox is None:
            inbox, self._inbox = [*self._inbox, self.step_costs.costs()], []
            if self.tp is not None:
                self.tp.broadcast(inbox)
        for message in inbox:
            if isinstance(message, ChunkCosts):
                self.chunk_costs = message
            elif isinstance(message, Req):
                seed = message.sampling_params.seed
                message.seed = (self._rng.getrandbits(31) if seed is None else seed) & SEED_MASK
                message.eos_token_ids = message.eos_token_ids or self.eos_token_ids
                self.masks.attach(message)
                self.prefill.waiting.append(message)
                self.live[message.rid] = message
            elif isinstance(message, FlushCacheRequest):
                self.cache.flush()
            elif (req := self.live.get(message.rid)) is not None:  # not ended yet
                self._end(req, FinishReason.ABORT)

    # ---- the step -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox or self.prefill.waiting or self.running or self.inflight)

    @torch.inference_mode()
    def step(self, inbox: Inbox | None = None) -> list[ReqOutput]:
        """Apply the inbox, schedule a batch and launch it, then process the batch before it.

        With overlap, batch N+1 is launched before batch N's results are read, so the host's
        work (scheduling N+1, processing N) runs while the device computes: scheduling needs
        nothing from N's results, as building N already advanced its requests' lengths (a
        request that N ends only wastes its row in N+1, and keeps its KV until N+1 is done).
        Without overlap each batch is processed right after its launch.
        """
        try:
            self._apply(inbox)
            with nvtx_range("schedule", self._is_cuda):
                batch = self._schedule()
            previous = self.inflight
            self.inflight = batch if self.overlap else None  # requests' releases wait for it
            if batch is not None:
                batch.launched_s = time.perf_counter()
                if previous is not None and self.masks.must_wait(previous, batch):
                    # Its grammar masks need batch N's tokens: forward, process N (that advances
                    # the grammars), then sample (SGLang's order).
                    logits = self.forward_thread.submit(self.engine.forward_logits, batch)
                    self._process(previous)
                    previous, mask = None, self.masks.mask(batch.rows)
                    batch.pending = self.forward_thread.submit(
                        lambda: self.engine.sample(batch, resolved(logits), mask)
                    )
                else:
                    mask = self.masks.mask(batch.rows)
                    batch.pending = self.forward_thread.submit(self.engine.forward, batch, mask)
            if not self.overlap:
                previous = batch
            if previous is not None:
                self._process(previous)
        except Exception as exc:
            if self.tp is None:
                raise
            self.tp.fail(exc)  # the ranks may disagree now: the group cannot go on
        events, self.events = self.events, []
        return events

    def _schedule(self) -> ForwardBatch | None:
        decodes = self.decode.schedule(self.running, inflight=self.inflight is not None)
        if decodes is None:  # a retraction must wait for the batch in flight: process it now
            self._drain()
            decodes = self.decode.schedule(self.running, inflight=False)
            assert decodes is not None
        # A step without decodes prefills as much as it may.
        chunks, admitted = self.prefill.schedule(self.running, self.chunk_costs, bool(decodes))
        for req in admitted:
            if req.num_retractions == 0:
                req.num_cached_prompt_tokens = req.cached_len
                self.counters.first_admission(req)
        self.running += admitted
        if not decodes and not chunks:
            return None
        num_drafts = sum(len(req.drafts) for req in decodes) if self.speculator is not None else 0
        self.counters.step(len(decodes), chunks, num_drafts)
        batch = build_batch(decodes, chunks, with_drafts=num_drafts > 0)
        for req, num_tokens in chunks:
            if num_tokens > 1:  # a prefill chunk: share its prefix right away
                self.cache.cache_prefix(req)
        return batch

    def _drain(self) -> None:
        batch, self.inflight = self.inflight, None
        if batch is not None:
            self._process(batch)

    def _process(self, batch: ForwardBatch) -> None:
        """A launched batch's results into its requests (its tokens, finishes and releases)."""
        assert batch.pending is not None
        result = resolved(batch.pending).result()
        self.step_costs.observe(batch, batch.launched_s, time.perf_counter())
        with nvtx_range("process", self._is_cuda):
            for index, scored in result.prompt_logprobs.items():
                batch.reqs[index].prompt_logprobs.extend(scored)
            for index, part in batch.pooled.items():
                batch.reqs[index].pooled += part
            for req in batch.scored_only:
                if not req.finished:
                    self._end(req, FinishReason.LENGTH)
            if self.speculator is not None and batch.with_drafts:
                rows = zip(result.token_ids, result.logprobs, strict=True)
                for req in dict.fromkeys(batch.rows):  # each request once, in order
                    self.speculator.verify(req, rows, self._take)
            else:
                self._take(batch.rows, result.token_ids, result.logprobs)
            for req in batch.release_after:
                self.cache.release(req)

    def _take(
        self, reqs: list[Req], token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> None:
        """Sampled tokens into their requests (output, grammar, events), token_ids[i] into
        reqs[i], in order; a request they end is released, and takes no more. One loop over a
        step's tokens, on locals: this is the host's largest cost per running request."""
        events, max_model_len = self.events, self.limits.max_model_len
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
            room_len = max_model_len - req.prompt_len - num_outputs
            reason = finish_reason(params, token_id, num_outputs, room_len, req.eos_token_ids)
            stop = reason is FinishReason.STOP  # an EOS or stop token: it ends, never shows
            events.append(
                ReqOutput(
                    req.rid,
                    () if stop else (token_id,),
                    reason,
                    () if logprob is None else (logprob,),
                    req.num_cached_prompt_tokens,
                    tuple(req.prompt_logprobs) if num_outputs == 1 else (),
                    token_id if stop else None,
                )
            )
            if reason is not None:
                self._finish(req, reason)
        self.counters.generation_tokens_total += num_taken

    def _end(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """The end of a request without a new token: aborted, done scoring its prompt
        (max_tokens 0: it ends here with its prompt logprobs), or failed (`error`, the server's:
        `fail_running` takes back what it holds)."""
        only_scored = reason == FinishReason.LENGTH and not req.output_ids
        prompt_logprobs = tuple(req.prompt_logprobs) if only_scored else ()
        pooling = req.sampling_params.pooling if only_scored else None
        embedding = embedding_bytes(pooling, req.pooled, req.prompt_len) if pooling else None
        self.events.append(
            ReqOutput(
                req.rid,
                (),
                reason,
                num_cached_prompt_tokens=req.num_cached_prompt_tokens,
                prompt_logprobs=prompt_logprobs,
                error=error,
                internal_error=error is not None,
                embedding=embedding,
            )
        )
        self._finish(req, reason, release=error is None)

    def _finish(self, req: Req, reason: FinishReason, release: bool = True) -> None:
        """`req` ends: it leaves the queue or the running batch and gives back what it holds.
        Its KV waits for the batch in flight if that batch uses it, so that nothing in flight
        reads a row or page handed to someone else."""
        req.finish_reason, req.grammar = reason, None
        del self.live[req.rid]
        if not release:
            return
        if req.table_row < 0:  # still waiting (an abort): only admission gives a row
            self.prefill.waiting.remove(req)
            return
        self.running.remove(req)
        if self.inflight is not None and req in self.inflight.reqs:
            self.inflight.release_after.append(req)
        else:
            self.cache.release(req)

    def fail_running(self, error: str) -> list[ReqOutput]:
        """After `step()` raised (a bug, a device out of memory): end every live request that is
        not waiting with `error` and take back all they hold, so one bad batch does not take the
        server down; waiting requests keep their place, what finished before stands. Nothing of
        theirs is cached (their KV may be incomplete) and the prefix cache is emptied (a failed
        chunk may have shared pages there before their KV was written). Raises when the state
        cannot be trusted: a tp group (the ranks may disagree), pages that do not add up."""
        if self.tp is not None:
            self.tp.fail(RuntimeError(f"a failed step cannot be recovered from: {error}"))
        deferred = [] if self.inflight is None else self.inflight.release_after
        self.inflight = None
        # No forward may write KV into the pages given back here: the thread runs tasks in
        # order, so once this no-op has run, every forward before it has finished.
        resolved(self.forward_thread.submit(lambda: None))
        self.engine.stream.synchronize()
        waiting = {id(req) for req in self.prefill.waiting}
        for req in [r for r in self.live.values() if id(r) not in waiting]:
            self._end(req, FinishReason.ERROR, error)
            if req in self.running:
                self.running.remove(req)
            if req.table_row >= 0:  # it holds a row and pages
                self.cache.discard(req)
        for req in deferred:
            self.cache.discard(req)
        self.cache.flush()
        self.check_page_accounting()
        events, self.events = self.events, []
        return events

    # ---- introspection and shutdown -----------------------------------------------------------

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
            # pages held by running requests or locked cache entries
            kv_cache_usage_ratio=(total - self.cache.num_available_pages) / total,
            num_free_pages=self.cache.num_available_pages,
            num_total_pages=total,
            num_retractions_total=self.decode.num_retractions,
            **self.counters.snapshot(),
        )

    def check_page_accounting(self) -> None:
        deferred = [] if self.inflight is None else self.inflight.release_after
        self.cache.check_page_accounting([*self.running, *deferred])

    def shutdown(self) -> None:
        """Process the batch in flight and stop the forward thread; as rank 0 of a tp group,
        stop the other ranks first and leave the group last (idempotent, never hangs on a dead
        rank)."""
        if self.tp is not None:
            self.tp.stop()
        try:
            self._drain()
            self.forward_thread.shutdown()
        except Exception:
            if self.tp is None:
                raise
            logger.warning("tp shutdown: the batch in flight needed a rank that is gone")
        finally:
            if self.tp is not None:
                self.tp.close()
