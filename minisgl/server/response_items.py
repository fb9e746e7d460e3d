"""The output items of one Responses API reply, built from its ChatDeltas as they come: a
`reasoning` item, a `message` with one `output_text` part, `function_call` items, in the order
the model wrote them; with an event queue, also OpenAI's stream events that build them.
"""

from __future__ import annotations

from typing import Any

from minisgl.chat import ChatDelta
from minisgl.chat.tool_parsers import ToolCallDelta
from minisgl.server.protocol import new_item_id
from minisgl.server.serving_chat import CallIds
from minisgl.server.sse import EventQueue

MESSAGE, REASONING, CALL = "message", "reasoning", "function_call"


class OutputItems:
    """One reply's ChatDeltas -> output items; with `events`, also the stream events that
    build them. One item is open at a time: the next kind of output closes it."""

    def __init__(self, events: EventQueue | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._events = events
        self._open: dict[str, Any] | None = None
        self._open_call: int | None = None  # ToolCallDelta.index of the open function call
        self._call_ids = CallIds()
        # Whitespace between items (the newlines after </think>, before a call) is held: it
        # starts a message only if text follows.
        self._held_text = ""
        self._held_logprobs: list[dict[str, Any]] = []

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, **fields)

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def feed(self, delta: ChatDelta, logprobs: list[dict[str, Any]]) -> None:
        """logprobs: of the tokens behind this delta; they go with its message text."""
        if delta.reasoning:
            self._write_reasoning(delta.reasoning)
        if delta.content:
            self._write_text(delta.content, logprobs)
        for call in delta.tool_calls:
            self._write_call(call)

    def finish(self, status: str) -> None:
        """Close the open item with `status` (completed, or incomplete when cut short)."""
        if not self.items and self._held_text:  # a reply of only whitespace is still a reply
            self._write_text("", [], flush=True)
        self._close(status)

    def _at(self, item: dict[str, Any], part: bool = True) -> dict[str, Any]:
        """Where an event about the open item (and its one content part) points."""
        where: dict[str, Any] = {"item_id": item["id"], "output_index": self._index}
        if part:
            where["content_index"] = 0
        return where

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> dict[str, Any]:
        self._close("completed")
        self._open = item
        self.items.append(item)
        self._emit("response.output_item.added", output_index=self._index, item=item)
        if part is not None:
            item["content"].append(part)
            self._emit("response.content_part.added", **self._at(item), part=part)
        return item

    def _write_reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != REASONING:
            empty = {"type": "reasoning_text", "text": ""}
            item = self._start(
                {
                    "id": new_item_id("rs"),
                    "type": REASONING,
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                },
                empty,
            )
        item["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", **self._at(item), delta=text)

    def _write_text(self, text: str, logprobs: list[dict[str, Any]], flush: bool = False) -> None:
        item = self._open
        if item is None or item["type"] != MESSAGE:
            if not text.strip() and not flush:
                self._held_text += text
                self._held_logprobs += logprobs
                return
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = self._start(
                {
                    "id": new_item_id("msg"),
                    "type": MESSAGE,
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
                empty,
            )
            text, logprobs = self._held_text + text, self._held_logprobs + logprobs
            self._drop_held()
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        self._emit("response.output_text.delta", **self._at(item), delta=text, logprobs=logprobs)

    def _drop_held(self) -> None:
        self._held_text, self._held_logprobs = "", []

    def _write_call(self, call: ToolCallDelta) -> None:
        item = self._open
        if call.name is not None or item is None or self._open_call != call.index:
            self._drop_held()
            item = self._start(
                {
                    "id": new_item_id("fc"),
                    "type": CALL,
                    "call_id": self._call_ids.get(0, call.index),
                    "name": call.name or "",
                    "arguments": "",
                    "status": "in_progress",
                },
                None,
            )
            self._open_call = call.index
        item["arguments"] += call.arguments
        if call.arguments:
            where = self._at(item, part=False)
            self._emit("response.function_call_arguments.delta", **where, delta=call.arguments)

    def _close(self, status: str) -> None:
        item, self._open, self._open_call = self._open, None, None
        if item is None:
            return
        if item["type"] == CALL:
            where = self._at(item, part=False)
            self._emit(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
        else:
            part = item["content"][0]
            if item["type"] == MESSAGE:
                done = {"text": part["text"], "logprobs": part["logprobs"]}
                self._emit("response.output_text.done", **self._at(item), **done)
            else:
                self._emit("response.reasoning_text.done", **self._at(item), text=part["text"])
            self._emit("response.content_part.done", **self._at(item), part=part)
        item["status"] = status
        self._emit("response.output_item.done", output_index=self._index, item=item)

    def assistant_message(self) -> dict[str, Any]:
        """The reply as a chat message: what a later turn's conversation holds."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        calls = []
        for item in self.items:
            if item["type"] == MESSAGE:
                message["content"] += item["content"][0]["text"]
            elif item["type"] == REASONING:
                message["reasoning_content"] = item["content"][0]["text"]
            else:
                function = {"name": item["name"], "arguments": item["arguments"]}
                calls.append({"id": item["call_id"], "type": "function", "function": function})
        if calls:
            message["tool_calls"] = calls
        return message
