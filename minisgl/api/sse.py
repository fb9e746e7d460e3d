"""Server-sent events framing and the JSON encoding of response bodies."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"
# Proxies (nginx) buffer responses unless told not to; streams must reach the client per token.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse_event(data: Any, name: str | None = None) -> str:
    """One event; with `name`, an `event:` line first (the Responses and Anthropic streams)."""
    head = f"event: {name}\n" if name is not None else ""
    return f"{head}data: {dumps(data)}\n\n"
