from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for /metrics and tests. Counters are totals since start."""

    num_running_reqs: int
    num_queue_reqs: int
    kv_cache_usage_ratio: float  # pages held by live requests (and their locked prefixes) / all
    num_free_pages: int  # free list plus evictable cache
    num_total_pages: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_prompt_tokens_total: int
    prefill_tokens_total: int  # prompt tokens actually computed (cache hits excluded)
    num_retractions_total: int
    aborted_requests_total: int
