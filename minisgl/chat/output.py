"""One choice's reply, parsed as it streams: reasoning, then content and tool calls."""

from typing import Any, Protocol

from minisgl.chat.reasoning import Mode, ReasoningParser
from minisgl.chat.streaming import ChatDelta, ToolCallDelta
from minisgl.chat.tool_parsers import ToolParser


class ChatOutputParser:
    """Text deltas in, `ChatDelta`s out. Reasoning is split off first; what remains goes to
    the tool parser, if any. `reasoning_tokens` counts the tokens of deltas that were (partly)
    reasoning, for usage.completion_tokens_details."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.reasoning_tokens = 0

    @property
    def num_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> ChatDelta:
        """`final`: `text` ends the reply, so what the parsers held back comes out with it."""
        parser = self._reasoning
        out = ChatDelta(content=text)
        if parser is not None:
            mode_before = parser.mode
            out = parser.feed(text, final)
            # this delta's tokens were reasoning, or opened it (<think> after MAYBE)
            if mode_before != Mode.CONTENT and parser.reasoned:
                self.reasoning_tokens += num_tokens
        if self._tools is None or not (out.content or final):
            return out
        parsed = self._tools.feed(out.content, final)
        parsed.reasoning = out.reasoning
        return parsed


# The kinds of block a reply is made of, in the order the model writes them.
REASONING, TEXT, CALL = "reasoning", "text", "call"


class BlockSink(Protocol):
    """Where `ReplyBlocks` writes: a dialect's own items (OpenAI's Responses output items,
    Anthropic's content blocks) and the stream events that build them."""

    def open(self, kind: str, call: ToolCallDelta | None) -> None: ...

    def write(self, kind: str, text: str, logprobs: list[Any]) -> None: ...

    def close(self, status: str) -> None: ...


class ReplyBlocks:
    """One reply's ChatDeltas as ordered blocks: reasoning, text, tool calls, one open at a
    time (the next kind of output, or the next call, closes it). Whitespace between blocks
    (the newlines after </think>, before a call) is held: it starts a text block only if text
    follows. `logprobs` travel with the text they belong to."""

    def __init__(self, sink: BlockSink) -> None:
        self._sink = sink
        self.num_blocks = 0
        self.num_calls = 0
        self._open: str | None = None
        self._held: tuple[str, list[Any]] = ("", [])  # whitespace (text, logprobs) between blocks

    def feed(self, delta: ChatDelta, logprobs: list[Any] | None = None) -> None:
        if delta.reasoning:
            self._write(REASONING, delta.reasoning, [])
        if delta.content:
            self._write(TEXT, delta.content, logprobs or [])
        for call in delta.tool_calls:
            if call.name is not None or self._open != CALL:  # a call's first delta has its name
                self._start(CALL, call)
                self.num_calls += 1
            self._sink.write(CALL, call.arguments, [])

    def finish(self, status: str = "completed") -> None:
        """Close the open block with `status` (completed, or incomplete when cut short)."""
        if not self.num_blocks and self._held[0]:  # a reply of only whitespace is a reply
            self._write(TEXT, "", [], flush=True)
        self._close(status)

    def _start(self, kind: str, call: ToolCallDelta | None) -> None:
        self._close("completed")
        self._open, self._held = kind, ("", [])
        self.num_blocks += 1
        self._sink.open(kind, call)

    def _write(self, kind: str, text: str, logprobs: list[Any], flush: bool = False) -> None:
        if self._open != kind:
            if kind == TEXT:
                text, logprobs = self._held[0] + text, self._held[1] + logprobs
                if not (text.strip() or flush):
                    self._held = text, logprobs
                    return
            self._start(kind, None)
        self._sink.write(kind, text, logprobs)

    def _close(self, status: str) -> None:
        if self._open is not None:
            self._open = None
            self._sink.close(status)
