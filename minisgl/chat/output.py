"""One choice's reply, parsed as it streams: reasoning, then content and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.chat.reasoning import Mode, ReasoningParser
from minisgl.chat.tool_parsers import ToolCallDelta, ToolParser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


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

    def feed(self, text: str, num_tokens: int = 0) -> ChatDelta:
        out = ChatDelta()
        parser = self._reasoning
        if parser is None:
            out.content = text
        else:
            mode_before = parser.mode
            split = parser.feed(text)
            # this delta's tokens were reasoning, or opened it (<think> after MAYBE)
            if mode_before == Mode.REASONING or (mode_before == Mode.MAYBE and parser.reasoned):
                self.reasoning_tokens += num_tokens
            out.reasoning, out.content = split.reasoning, split.content
        return self._parse_tools(out, final=False)

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out.reasoning, out.content = split.reasoning, split.content
        return self._parse_tools(out, final=True)

    def _parse_tools(self, out: ChatDelta, final: bool) -> ChatDelta:
        if self._tools is None:
            return out
        parsed = self._tools.feed(out.content) if out.content else None
        content = parsed.content if parsed is not None else ""
        calls = list(parsed.calls or []) if parsed is not None else []
        if final:
            rest = self._tools.finish()
            content += rest.content
            calls += rest.calls or []
        out.content, out.tool_calls = content, calls
        return out
