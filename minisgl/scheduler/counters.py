"""The scheduler's counters (totals since start) and per-step histograms: what `stats()`
reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minisgl.core import Req
from minisgl.scheduler.stats import SchedulerHistograms


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0  # prompt tokens looked up in the prefix cache (first admission)
    cached_prompt_tokens: int = 0  # of those, tokens found in the cache
    prefill_tokens: int = 0  # prompt tokens actually computed (cache hits excluded)
    generation_tokens: int = 0
    histograms: SchedulerHistograms = field(default_factory=SchedulerHistograms)

    def first_admission(self, req: Req) -> None:
        """A request admitted for the first time (not after a retraction), its prefix matched."""
        self.prompt_tokens += req.prompt_len
        self.cached_prompt_tokens += req.cached_len
        if req.arrival_time > 0:  # set by the server; offline requests have none
            self.histograms.queue_time_s.observe(time.monotonic() - req.arrival_time)

    def step(self, items: list[tuple[Req, int]]) -> None:
        """A step's (request, tokens to compute) items, before they advance the requests."""
        self.histograms.observe_step(len(items), sum(num_tokens for _, num_tokens in items))
        # the prompt tokens among them (cache hits never get here)
        self.prefill_tokens += sum(max(0, min(r.prompt_len - r.cached_len, n)) for r, n in items)
