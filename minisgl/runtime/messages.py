"""Messages between minisgl processes, their codec and the queue that carries them.

Every receiver binds its PULL socket and senders connect (MessageQueue does it). The codec is
msgpack with an explicit registry of message tags. Who sends what over which socket, and how a
message is encoded: docs/server.md#process-layout."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from minisgl.core import Constraint, FinishReason, ReqOutput, SamplingParams, TokenLogprob
from minisgl.pooling import Pooling
from minisgl.stats import HistogramSnapshot, SchedulerStats

# ---------------------------------------------------------------------------------------------
# Messages


@dataclass(frozen=True)
class TokenizedRequest:
    """A new request for the scheduler, the prompt already token ids; the scheduler forwards it
    to the detokenizer, the prompt cut to the tail that seeds the decoding window."""

    rid: str
    input_ids: tuple[int, ...]
    sampling_params: SamplingParams
    # sampling_params.constraint compiled by the API server (minisgl.grammar), so the scheduler
    # never compiles on its loop; None for unconstrained requests.
    grammar_json: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request (client gone, or a stop string seen); its KV pages are freed."""

    rid: str


@dataclass(frozen=True)
class StatsRequest:
    """Ping + stats query; the scheduler answers with a StatsReply carrying the same id."""

    request_id: int


@dataclass(frozen=True)
class StatsReply:
    """The scheduler's numbers (SchedulerStats defines them and how /metrics exports them) and
    what the API server needs to know about the model."""

    request_id: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_capacity_tokens: int  # total pages x page size: the most one sequence can hold
    stats: SchedulerStats


@dataclass(frozen=True)
class FlushCacheRequest:
    """Empty the prefix cache (SGLang's /flush_cache); only done when the scheduler is idle.
    Sent on the scheduler's request socket, so it comes after every request sent before it."""

    request_id: int


@dataclass(frozen=True)
class FlushCacheReply:
    request_id: int
    flushed: bool
    message: str = ""


# ---------------------------------------------------------------------------------------------
# Codec

# The msgpack ext type code of a registered type: its payload is [tag, values...], a dataclass's
# init fields or an enum's value.
EXT_REGISTERED = 1
# Tags are part of the wire format between processes of one launch: append, never renumber.
_TAGS: dict[type, int] = {
    SamplingParams: 1,
    TokenLogprob: 2,
    ReqOutput: 3,
    TokenizedRequest: 10,
    AbortRequest: 11,
    StatsRequest: 16,
    StatsReply: 17,
    Constraint: 4,
    FlushCacheRequest: 18,
    FlushCacheReply: 19,
    SchedulerStats: 5,
    HistogramSnapshot: 6,
    FinishReason: 20,
    Pooling: 7,
}
_BY_TAG = {tag: cls for cls, tag in _TAGS.items()}
_INIT_FIELDS = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.init)
    for cls in _TAGS
    if dataclasses.is_dataclass(cls)
}


def _default(obj: Any) -> Any:
    cls = type(obj)
    if cls is tuple:
        return list(obj)
    if cls not in _TAGS:
        raise TypeError(f"cannot encode {cls.__name__}: not in the message registry")
    values = [obj.value] if isinstance(obj, Enum) else [getattr(obj, f) for f in _INIT_FIELDS[cls]]
    return msgpack.ExtType(EXT_REGISTERED, encode([_TAGS[cls], *values]))


def _ext_hook(code: int, data: bytes) -> Any:
    # `code` is EXT_REGISTERED: _default makes every ext value there is.
    tag, *values = decode(data)
    return _BY_TAG[tag](*values)  # an enum's one value, or a dataclass's fields in order


def encode(message: Any) -> bytes:
    # strict_types: FinishReason is a str subclass and must reach _default, not pack as a str.
    return msgpack.packb(message, default=_default, strict_types=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False)


# ---------------------------------------------------------------------------------------------
# Endpoints and the queue


@dataclass(frozen=True)
class Endpoints:
    """ipc:// socket paths inside one private per-launch folder."""

    root: str
    scheduler_in: str = field(init=False)
    scheduler_ctl: str = field(init=False)
    detokenizer_in: str = field(init=False)
    api_in: str = field(init=False)

    def __post_init__(self) -> None:
        for socket in dataclasses.fields(self)[1:]:  # every field but `root`: one socket each
            object.__setattr__(self, socket.name, f"ipc://{os.path.join(self.root, socket.name)}")

    @classmethod
    def create(cls) -> Endpoints:
        # mkdtemp makes the folder with mode 0700: other users cannot connect to our sockets.
        return cls(tempfile.mkdtemp(prefix="minisgl-"))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# Sends must never block a process's loop: no high-water mark, and closing drops unsent data
# after this long instead of hanging on a peer that is gone.
LINGER_MS = 500
MS_PER_S = 1000


class MessageQueue:
    """A typed message pipe over one ZeroMQ socket: "push" sends, "pull" receives.

    `asyncio=True` uses pyzmq's asyncio socket, for the API server's event loop: then `aget` is
    the way to receive. `put` never blocks either way.
    """

    def __init__(self, kind: Literal["push", "pull"], endpoint: str, *, asyncio: bool = False):
        self.kind = kind
        context: zmq.Context = zmq.asyncio.Context.instance() if asyncio else zmq.Context.instance()
        self._socket = context.socket(zmq.PUSH if kind == "push" else zmq.PULL)
        for option, value in ((zmq.LINGER, LINGER_MS), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            self._socket.setsockopt(option, value)
        if kind == "pull":  # every receiver binds its socket; senders connect
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)

    def put(self, message: Any) -> None:
        assert self.kind == "push", "cannot send on a pull socket"
        self._socket.send(encode(message), copy=False)

    def get(self, timeout_s: float) -> Any | None:
        """Next message; None if nothing arrives within timeout_s (0: do not wait)."""
        if not self._socket.poll(int(timeout_s * MS_PER_S), zmq.POLLIN):
            return None
        return decode(self._socket.recv())

    def get_all(self, timeout_s: float = 0.0) -> list[Any]:
        """Every message waiting, after waiting up to timeout_s for the first one."""
        messages: list[Any] = []
        while (message := self.get(0.0 if messages else timeout_s)) is not None:
            messages.append(message)
        return messages

    async def aget(self) -> Any:
        return decode(await self._socket.recv())  # type: ignore[misc]

    def close(self) -> None:
        self._socket.close()
