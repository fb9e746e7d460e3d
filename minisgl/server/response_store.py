"""Stored responses (`store: true`, OpenAI's default): what GET /v1/responses/{id} returns and
what `previous_response_id` continues.

In the API process's memory, so lost on restart and private to one server (behind a gateway,
a follow-up must reach the same replica). Bounded by count and by size: the oldest entries
go first. Each entry keeps its whole conversation, so a long chain costs its length once per
turn; the size bound is what keeps that in check.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as the client received it
    conversation: list[dict[str, Any]]  # chat messages, this response's reply included
    input_items: list[dict[str, Any]]  # this request's input, as GET .../input_items lists it
    size_chars: int


class ResponseStore:
    def __init__(
        self, max_entries: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS
    ) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        input_items: list[dict[str, Any]] | None = None,
    ) -> None:
        input_items = input_items or []
        size = sum(len(json.dumps(part)) for part in (response, conversation, input_items))
        if size > self._max_chars:
            return  # larger than the whole store: keeping it would evict everything else
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, conversation, input_items, size)
        self._chars += size
        while len(self._entries) > self._max_entries or self._chars > self._max_chars:
            _, oldest = self._entries.popitem(last=False)
            self._chars -= oldest.size_chars

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # a chain in use stays
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size_chars
        return True
