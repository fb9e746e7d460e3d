"""How a dialect's events leave: as server-sent events (a stream), or folded into the one reply
of a non-streaming request, so the two cannot disagree. Whatever ends a stream early (timeout,
a failed choice, the backend stopping, a bug) reaches the client as the dialect's error
events, never as a cut connection."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from minisgl.api.errors import ClientDisconnected, stream_error_body

if TYPE_CHECKING:
    from minisgl.api.pipeline import Run

# A dialect's wire events: (SSE event name or None, payload).
WireEvent = tuple[str | None, dict[str, Any]]
# A dialect's frames that end a stream which failed, from the error's body (OpenAI's shape).
ErrorFrames = Callable[[dict[str, Any]], list[str]]


class EventBuffer:
    """Named events made while a reply is built, sent after each output. Each is a snapshot
    (what it shows, an item or a block, keeps changing after it); `numbered` adds OpenAI's
    `sequence_number` (the Responses API)."""

    def __init__(self, numbered: bool = False) -> None:
        self._events: list[WireEvent] = []
        self._numbered = numbered
        self._count = 0

    def emit(self, kind: str, **fields: Any) -> None:
        number = {"sequence_number": self._count} if self._numbered else {}
        self._count += 1
        self._events.append((kind, {"type": kind, **number, **copy.deepcopy(fields)}))

    def take(self) -> list[WireEvent]:
        events, self._events = self._events, []
        return events


# HTTP status for a response nobody will read (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499

SSE_DONE = "data: [DONE]\n\n"
# Proxies (nginx) buffer responses unless told not to; streams must reach the client per token.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: Any, name: str | None = None) -> str:
    """One event; with `name`, an `event:` line first (the Responses and Anthropic streams)."""
    head = f"event: {name}\n" if name is not None else ""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))  # compact, UTF-8 as is
    return f"{head}data: {payload}\n\n"


async def stream_frames(
    run: Run, events: AsyncIterator[WireEvent], error_frames: ErrorFrames | None = None
) -> AsyncIterator[str]:
    """The events as server-sent events. Whatever ends the stream early reaches the client as
    the dialect's `error_frames`; a client that left gets nothing. None: OpenAI's streams, which
    end with [DONE], after their error event too."""
    try:
        async for name, payload in events:
            yield sse_event(payload, name)
        if error_frames is None:
            yield SSE_DONE
    except ClientDisconnected:
        return
    except Exception as exc:
        body = stream_error_body(exc, run.id)
        for frame in [sse_event(body), SSE_DONE] if error_frames is None else error_frames(body):
            yield frame
    finally:
        run.close()


async def respond(
    run: Run,
    events: AsyncIterator[WireEvent],
    stream: bool,
    fold: Callable[[list[dict[str, Any]]], dict[str, Any] | list[Any]],
    error_frames: ErrorFrames | None = None,
) -> Response:
    """A stream of the events, or their fold: the reply of a non-streaming request."""
    if stream:
        frames = stream_frames(run, events, error_frames)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        payloads = [payload async for _, payload in events]
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    finally:
        run.close()
    return JSONResponse(fold(payloads))
