"""The forward context: what attention layers need for the batch being computed.

Set by the engine around each forward (the second of the two set-once-per-forward globals the
design allows), so model code keeps the plain `forward(positions, hidden)` signature. It lives
here, beside the backends it carries, so models read it without importing the engine.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from minisgl.attention.base import AttentionBackend
from minisgl.kvcache.pool import KVPool


@dataclass
class ForwardContext:
    backend: AttentionBackend
    kv_pool: KVPool
    metadata: Any  # the backend's own per-batch metadata


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("nested forward: one forward runs at a time per process")
    _CONTEXT = ctx
    try:
        yield
    finally:
        _CONTEXT = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a forward context")
    return _CONTEXT
