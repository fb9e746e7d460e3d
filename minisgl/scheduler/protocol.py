"""The one interface the drivers (offline `LLM`, the server's scheduler process, tp followers)
program against: the single-rank `Scheduler` and the tensor-parallel `TPScheduler` both
implement it."""

from __future__ import annotations

from typing import Protocol

from minisgl.core import Req, ReqOutput
from minisgl.scheduler.stats import SchedulerStats


class SchedulerAPI(Protocol):
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    page_size: int

    @property
    def model_path(self) -> str:
        """The resolved local checkpoint folder (tokenizer files live there too)."""
        ...

    def validate(self, req: Req) -> None:
        """Raise ValueError for a request that could never run (before anything is queued)."""

    def add_request(self, req: Req) -> None: ...

    def abort_request(self, rid: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[ReqOutput]:
        """Schedule and launch one batch, process finished results; what happened to whom."""
        ...

    def fail_running(self, error: str) -> list[ReqOutput]:
        """After `step()` raised: end the admitted requests with `error` and go on from a known
        state (their outputs); raise when that is not possible."""
        ...

    def stats(self) -> SchedulerStats: ...

    def check_health(self) -> None:
        """Raise if a part of the scheduler (a tp rank) died."""

    def check_page_accounting(self) -> None: ...

    def flush_cache(self) -> None: ...

    def shutdown(self) -> None: ...
