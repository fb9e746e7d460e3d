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
from minisgl.api.request import JsonObject

if TYPE_CHECKING:
    from minisgl.api.pipeline import Run

# A dialect's events that end a stream which failed, from the error's body (OpenAI's shape).
ErrorEvents = Callable[[JsonObject], list[JsonObject]]
# HTTP status for a response nobody will read (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499
SSE_DONE = "data: [DONE]\n\n"
# Proxies (nginx) buffer responses unless told not to; streams must reach the client per token.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventBuffer:
    """Typed events made while a reply is built, sent after each output. Each is a snapshot
    (what it shows, an item or a block, keeps changing after it); `numbered` adds OpenAI's
    `sequence_number` (the Responses API)."""

    def __init__(self, numbered: bool = False) -> None:
        self._events: list[JsonObject] = []
        self._numbered = numbered
        self._count = 0

    def emit(self, kind: str, **fields: Any) -> None:
        number = {"sequence_number": self._count} if self._numbered else {}
        self._count += 1
        self._events.append({"type": kind, **number, **copy.deepcopy(fields)})

    def take(self) -> list[JsonObject]:
        events, self._events = self._events, []
        return events


def sse_event(data: JsonObject, named: bool = False) -> str:
    """One event; `named`: its `type` on an `event:` line first (the Responses and Anthropic
    streams)."""
    head = f"event: {data['type']}\n" if named else ""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))  # compact, UTF-8 as is
    return f"{head}data: {payload}\n\n"


async def stream_frames(
    run: Run, events: AsyncIterator[JsonObject], error_events: ErrorEvents | None = None
) -> AsyncIterator[str]:
    """The events as server-sent events; a client that left gets nothing more. With
    `error_events` each is named by its `type` and what ends the stream early becomes those
    events; without (OpenAI's streams) the stream ends with [DONE], after its error too."""
    named = error_events is not None
    try:
        async for event in events:
            yield sse_event(event, named)
    except ClientDisconnected:
        return
    except Exception as exc:
        body = stream_error_body(exc, run.id)
        for event in error_events(body) if error_events else [body]:
            yield sse_event(event, named)
    finally:
        run.close()
    if not named:
        yield SSE_DONE


async def respond(
    run: Run,
    events: AsyncIterator[JsonObject],
    stream: bool,
    fold: Callable[[list[JsonObject]], JsonObject | list[Any]],
    error_events: ErrorEvents | None = None,
) -> Response:
    """A stream of the events, or their fold: the reply of a non-streaming request."""
    if stream:
        return StreamingResponse(
            stream_frames(run, events, error_events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        payloads = [payload async for payload in events]
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    finally:
        run.close()
    return JSONResponse(fold(payloads))
