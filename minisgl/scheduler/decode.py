"""Decode: every running request past its prompt computes one token per step. When pages run
short, a running request is retracted to the queue front, its prefix cached
(docs/architecture.md#one-requests-life, step 7)."""

import logging

from minisgl.core import Req
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.speculative import NgramSpeculator

logger = logging.getLogger(__name__)


class DecodeManager:
    def __init__(
        self,
        cache: CacheManager,
        prefill: PrefillManager,
        speculator: NgramSpeculator | None = None,
    ) -> None:
        self.cache = cache
        self._prefill = prefill  # where retracted requests go (the waiting queue's front)
        self._speculator = speculator
        self.num_retractions = 0

    def schedule(self, running: list[Req], inflight: bool) -> list[Req] | None:
        """The requests of `running` that decode a token this step, retracting the newest ones
        (out of `running`) if KV runs out. None: a retraction is needed while a batch is in
        flight, which may still use the victim's pages: process that batch, then ask again."""
        while (victim := self._prefill.victim(running)) is not None:
            if inflight:  # priority: a waiting request of a higher class takes its place
                return None
            self._retract(running, victim)
        # Req.finished and Req.remaining_prefill_len spelled out: this runs for every running
        # request every step.
        reqs = [
            r
            for r in running
            if r.finish_reason is None
            and r.device_len - r.cached_len == 1
            and r.device_len - r.prompt_len < r.sampling_params.max_tokens  # sampled, in flight too
        ]
        if self._speculator is not None and self._speculator.propose(reqs):
            if self.cache.reserve(reqs, [r.device_len + len(r.drafts) for r in reqs]):
                return reqs
            # Short of pages: plain decodes. What was written past each request's end is
            # overwritten before anything reads it.
            for req in reqs:
                req.drafts = []
        # The usual case. A decode's pages cover its cached_len (device_len - 1) positions in
        # whole pages, so only one whose device_len - 1 starts a page can need one: those alone
        # are looked at (their page lists are cold in the CPU's caches after a forward).
        ps = self.cache.page_size
        crossing = [r for r in reqs if (r.device_len - 1) % ps == 0]
        if self.cache.reserve(crossing, [req.device_len for req in crossing]):
            return reqs
        # Short of pages: one by one, oldest (of the highest class) first; victims from the end.
        rank = self._prefill.policy.priority_class
        items: list[Req] = []
        for req in sorted(reqs, key=lambda r: -rank(r)):
            if req.table_row < 0:  # retracted while making room for an older request
                continue
            while not self.cache.reserve([req], [req.device_len]):
                if inflight:
                    return None
                if len(running) == 1:
                    raise RuntimeError("KV pool too small for one request (admission let it in)")
                self._retract(running, min(reversed(running), key=rank))
                if req.table_row < 0:  # it was the newest and got retracted itself
                    break
            else:
                items.append(req)
        return items

    def _retract(self, running: list[Req], victim: Req) -> None:
        """Back to the queue's front (it was admitted before anything still waiting)."""
        running.remove(victim)
        self.cache.release(victim)
        victim.device_len = len(victim.all_ids)
        victim.num_retractions += 1
        self.num_retractions += 1
        self._prefill.waiting.insert(0, victim)
        logger.debug("retracted %s at %d tokens", victim.rid, victim.device_len)
