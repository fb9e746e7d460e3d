"""Failure recovery: after a step raised (a bug, a device out of memory), end every admitted
request with the error and start over from a known state, so one bad batch does not take the
server down. Requests still waiting keep their place.

The failed step's requests give their pages back without caching them (their KV may be
incomplete), and the prefix cache is emptied: the failed batch may have shared pages in it (a
prefill chunk's) whose KV was never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.core import FinishReason

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler


def fail_admitted(scheduler: Scheduler, error: str) -> None:
    """End every live request that is not waiting with `error` (an ERROR event) and take back
    all they hold. What finished before the failure stands."""
    outputs, cache, running = scheduler.outputs, scheduler.cache, scheduler.running
    deferred = scheduler.loop.abandon()
    ended = outputs.ended_rids()
    waiting_ids = {id(req) for req in scheduler.prefill.waiting}
    # The running requests, and any the failure caught between the queue and the batch.
    for req in list(outputs.live.values()):
        if id(req) in waiting_ids or req.rid in ended:
            continue
        if not req.finished:
            outputs.end(req, FinishReason.ERROR, error)
        if req in running:
            running.remove(req)
        if req.table_row >= 0:  # it holds a row and pages
            cache.discard(req)
    for req in deferred:
        cache.discard(req)
    cache.flush()
