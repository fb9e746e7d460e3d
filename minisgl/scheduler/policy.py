"""Who goes first: the order of the waiting queue, and which running request gives way.

One ordering, from the policies that are on: tenant fairness, then priority, then lpm, then the
queue position. Admission follows it and stops at the first request that does not fit; with
priority on, that request retracts a running one of a lower class (`victim`). The rules and their
reasons: docs/server.md#scheduling-policies."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from minisgl.config import ServerArgs
from minisgl.core import Req

if TYPE_CHECKING:
    from minisgl.kvcache.radix import RadixCache

# VTC weights: a generated token costs a decode step of its own; a prompt token is one of
# hundreds computed together (the paper's choice, 1 and 2).
INPUT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0
# SGLang's threshold: past this many waiting requests, lpm falls back to arrival order.
LPM_MAX_WAITING = 128
SHARED_TENANT = "shared"  # requests that name no user and present no API key
# Counters of idle tenants are forgotten past this many tenants (they return at the floor).
MAX_TRACKED_TENANTS = 4096


def tenant_of(req: Req) -> str:
    return req.sampling_params.user or SHARED_TENANT


class SchedulePolicy:
    """The order of the waiting queue (`order`), the tenants' counters (`charge`) and who gives
    way to a more urgent request (`victim`): the rules of the module docstring."""

    def __init__(self, args: ServerArgs, prefix_cache: RadixCache) -> None:
        self.priority = args.enable_priority_scheduling
        self.fairness = args.tenant_fairness
        self._sign = -1 if args.schedule_low_priority_values_first else 1
        self._aging_s = args.priority_aging_s
        self._lpm = args.schedule_policy == "lpm"
        self._prefix_cache = prefix_cache
        self.counters: dict[str, float] = {}  # tenant -> weighted tokens served (VTC)
        self._active: set[str] = set()  # tenants with a request waiting or running, last look

    def priority_class(self, req: Req) -> int:
        """Higher goes first; 0 for all without priority scheduling."""
        if not self.priority:
            return 0
        aged = math.floor(req.arrival_time / self._aging_s) if self._aging_s else 0
        return self._sign * req.sampling_params.priority - aged

    def order(self, waiting: list[Req], running: list[Req]) -> Iterator[Req]:
        """The waiting requests, the one to admit first first. Under fairness the order is lazy:
        admitting a request charges its tenant (`charge`), which may change who is next."""
        lpm = self._lpm and len(waiting) <= LPM_MAX_WAITING
        ranked = list(waiting)  # sorted is stable: queue order among equals
        if self.priority or lpm:
            ranked.sort(key=lambda r: (-self.priority_class(r), -self._cached_len(r) if lpm else 0))
        if not self.fairness:
            return iter(ranked)
        self._lift_returning({tenant_of(r) for r in [*waiting, *running]})
        return self._by_tenant(ranked)

    def charge(self, req: Req, weighted_tokens: float) -> None:
        if self.fairness:
            tenant = tenant_of(req)
            self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted_tokens

    def victim(self, req: Req, running: list[Req]) -> Req | None:
        """The running request to retract so that `req` starts now: of a lower class (and of
        `req`'s tenant under fairness), the lowest and newest; None if there is none."""
        rank = self.priority_class(req)
        lower = [
            r
            for r in running
            if self.priority_class(r) < rank
            and (not self.fairness or tenant_of(r) == tenant_of(req))
        ]
        return min(reversed(lower), key=self.priority_class, default=None)

    def _cached_len(self, req: Req) -> int:
        if req.scores_prompt:  # it computes its whole prompt (CacheManager.admit)
            return 0
        return self._prefix_cache.match_prefix(req.all_ids[:-1]).matched_len

    def _lift_returning(self, active: set[str]) -> None:
        """Tenants back from idle start at the smallest counter of those that stayed active (the
        largest counter when none did: no one banks credit across an idle server)."""
        stayed = active & self._active
        counters = self.counters
        if stayed:
            floor = min(counters.get(t, 0.0) for t in stayed)
        else:
            floor = max(counters.values(), default=0.0)
        for tenant in active - stayed:
            counters[tenant] = max(counters.get(tenant, 0.0), floor)
        if len(counters) > MAX_TRACKED_TENANTS:
            for tenant in [t for t in counters if t not in active]:
                del counters[tenant]
        self._active = active

    def _by_tenant(self, ranked: list[Req]) -> Iterator[Req]:
        queues: dict[str, deque[Req]] = {}  # by tenant, in ranked order (ties: the first)
        for req in ranked:
            queues.setdefault(tenant_of(req), deque()).append(req)
        while queues:
            tenant = min(queues, key=lambda t: self.counters.get(t, 0.0))
            yield queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
