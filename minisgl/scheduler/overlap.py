"""The overlap loop: batch N+1 is scheduled and launched before batch N's results are
processed, so host-side scheduling hides behind the forward.

On CUDA "launched" means queued on the engine's stream (nothing waits until N's results are
read); on CPU, where overlap is opt-in, the forward runs on a worker thread. Requests that finish
in batch N may still be in batch N+1: their extra token is dropped and their pages and table row
are released only after N+1 completes, so nothing in flight ever reads a row or page that was
handed to someone else. Without overlap each batch is processed right after its launch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from minisgl.core import Req
from minisgl.engine.batch import ForwardBatch, PendingOutput, VocabMask
from minisgl.engine.engine import Engine
from minisgl.scheduler.batch import Launched, resolved
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.grammar_masks import GrammarMasks

_T = TypeVar("_T")


class OverlapLoop:
    def __init__(
        self,
        engine: Engine,
        enabled: bool,
        cache: CacheManager,
        masks: GrammarMasks,
        process: Callable[[Launched], None],
    ) -> None:
        self.engine = engine
        self.enabled = enabled
        self.cache = cache
        self.masks = masks
        self._process = process  # the scheduler's: a batch's results into its requests
        self.inflight: Launched | None = None  # launched, results not processed yet
        # CPU overlap needs a thread to run the forward; CUDA launches are asynchronous anyway.
        threaded = enabled and not engine.stream.is_cuda  # CUDA overlaps on its stream instead
        self._executor = ThreadPoolExecutor(1, "minisgl-forward") if threaded else None

    def run(self, batch: tuple[ForwardBatch, Launched] | None) -> None:
        """Launch this step's batch, if any, and process the one before it."""
        previous, self.inflight = self.inflight, None
        if batch is not None:
            fb, launched = batch
            rows = launched.rows  # a request per sampled row
            if self.enabled:
                self.inflight = launched  # before processing `previous`: its releases wait
            if previous is not None and self.masks.must_wait(previous.sampled, rows):
                logits = self._submit(self.engine.forward_logits, fb)
                self._process(previous)  # advances the grammars by batch N's tokens
                previous = None
                launched.pending = self._submit(self._sample, fb, logits, self.masks.mask(rows))
            else:
                launched.pending = self._submit(self.engine.forward, fb, self.masks.mask(rows))
            if not self.enabled:
                self._process(launched)
        if previous is not None:
            self._process(previous)

    def drain(self) -> None:
        """Process the batch in flight now (scheduling must see its results first)."""
        launched, self.inflight = self.inflight, None
        if launched is not None:
            self._process(launched)

    def release(self, req: Req) -> None:
        """Give back a finished request's KV and row, or, when the batch in flight uses them,
        once that batch is processed."""
        if self.inflight is not None and req in self.inflight.reqs:
            self.inflight.release_after.append(req)
        else:
            self.cache.release(req)

    @property
    def deferred_releases(self) -> list[Req]:
        """Finished requests whose KV the batch in flight still holds."""
        return [] if self.inflight is None else self.inflight.release_after

    def abandon(self) -> list[Req]:
        """After a failed step: forget the batch in flight once no forward can still write KV
        (into pages the caller is about to give back). Returns its deferred releases."""
        deferred, self.inflight = self.deferred_releases, None
        if self._executor is not None:
            # The thread runs tasks in submission order: once this no-op has run, every earlier
            # batch is done.
            self._executor.submit(lambda: None).result()
        self.engine.stream.synchronize()
        return deferred

    def shutdown(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _submit(self, fn: Callable[..., _T], *args: Any) -> _T | Future[_T]:
        """Run on the forward thread (CPU overlap: tasks run in submission order) or here."""
        if self._executor is not None:
            return self._executor.submit(fn, *args)
        return fn(*args)

    def _sample(self, fb: ForwardBatch, logits: Any, vocab_mask: VocabMask | None) -> PendingOutput:
        return self.engine.sample(fb, resolved(logits), vocab_mask)
