"""Server-sent events framing and JSON encoding of response bodies."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"
# Proxies (nginx) buffer responses unless told not to; streams must reach the client per token.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse_event(data: Any) -> str:
    return f"data: {dumps(data)}\n\n"


def named_event(kind: str, data: Any) -> str:
    """An event with an `event:` line, as the Responses and Anthropic streams send them."""
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


class EventQueue:
    """A stream's named events as text, in the order they are made; `numbered` adds OpenAI's
    `sequence_number` to each (the Responses API)."""

    def __init__(self, numbered: bool) -> None:
        self._pending: list[str] = []
        self._numbered = numbered
        self._sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> None:
        # Serialized now: what an event shows (an item, a block) keeps changing after it.
        event: dict[str, Any] = {"type": kind}
        if self._numbered:
            event["sequence_number"] = self._sequence_number
            self._sequence_number += 1
        self._pending.append(named_event(kind, {**event, **fields}))

    def take(self) -> list[str]:
        events, self._pending = self._pending, []
        return events
