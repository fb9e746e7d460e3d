"""Tool calls in the model's text -> OpenAI tool_calls, incrementally.

Every parser turns text deltas into (content, call deltas). A call is reported as a first delta
with its name and empty arguments, then argument text; handlers add ids and the OpenAI shape.
As with reasoning, the non-streamed answer is the same machine fed all the text at once.

- `hermes` / `qwen25` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks; text outside them is content. A block is reported when it closes, so a
  malformed one can still be returned as content, unchanged.
- `llama3_json` (Llama 3.x): the reply is `{"name": ..., "parameters": {...}}` objects
  (optionally after `<|python_tag|>`, separated by `;`); a reply that does not start with one
  is content.
- `NamedCallParser` / `RequiredCallsParser`: replies written under a grammar for
  `tool_choice` naming a function (the arguments object itself, streamed as it comes) or
  `"required"` (a JSON array of {"name", "parameters"}); see minisgl.chat.requests.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from minisgl.chat.streaming import find_first, partial_tag_len, split_trailing_space

TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position in the reply
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # argument text to append


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCallDelta] | None = None

    def add_call(self, index: int, name: str, arguments: str) -> None:
        self.calls = self.calls or []
        self.calls.append(ToolCallDelta(index, name, ""))
        if arguments:
            self.calls.append(ToolCallDelta(index, None, arguments))


def _as_call(value: Any, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in arg_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if not isinstance(arguments, dict) or not value["name"]:
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolParser(ABC):
    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.num_calls = 0

    def _room(self) -> bool:
        return self.max_calls is None or self.num_calls < self.max_calls

    @abstractmethod
    def feed(self, text: str) -> ToolDelta: ...

    @abstractmethod
    def finish(self) -> ToolDelta: ...


class HermesParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._inside = False  # between <tool_call> and </tool_call>
        self._after_block = False  # whitespace right after a block is not content
        self._space = ""  # whitespace before the open block: content again if it is malformed

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        content: list[str] = []
        while self._buf:
            if self._inside:
                end = self._buf.find(HERMES_END)
                if end < 0 and not final:
                    break
                body = self._buf if end < 0 else self._buf[:end]
                closing = "" if end < 0 else HERMES_END
                self._buf = "" if end < 0 else self._buf[end + len(HERMES_END) :]
                self._inside = False
                self._block(out, content, body, closing)
                continue
            if self._after_block:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._after_block = stripped, False
            at, _ = find_first(self._buf, (HERMES_START,))
            if at >= 0 and self._room():
                before, self._space = split_trailing_space(self._buf[:at])
                content.append(before)
                self._buf = self._buf[at + len(HERMES_START) :]
                self._inside = True
                continue
            if final or at >= 0:
                content.append(self._buf)
                self._buf = ""
                break
            hold = partial_tag_len(self._buf, (HERMES_START,))
            ready, space = split_trailing_space(self._buf[: len(self._buf) - hold])
            content.append(ready)
            self._buf = space + self._buf[len(self._buf) - hold :]
            break
        out.content = "".join(content)
        return out

    def _block(self, out: ToolDelta, content: list[str], body: str, closing: str) -> None:
        """A whole block (or, at the end, an unclosed one): a call, or content as written."""
        try:
            call = _as_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            content.append(self._space + HERMES_START + body + closing)
            return
        out.add_call(self.num_calls, *call)
        self.num_calls += 1
        self._after_block = True


class Llama3JsonParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._mode = "start"  # start -> calls | content

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return out
            if head.startswith("{"):
                self._mode, self._buf = "calls", head
            else:
                self._mode = "content"
        if self._mode == "calls":
            self._calls(out, final)
        if self._mode == "content":
            out.content += self._buf
            self._buf = ""
        return out

    def _calls(self, out: ToolDelta, final: bool) -> None:
        while True:
            if self.num_calls > 0:  # between calls: "; " separators
                self._buf = self._buf.lstrip().removeprefix(";").lstrip()
            if not self._buf:
                return
            try:
                value, end = _DECODER.raw_decode(self._buf)
            except ValueError:
                if final:
                    self._mode = "content"  # an unfinished or broken object
                return
            call = _as_call(value, ("parameters", "arguments"))
            if call is None or not self._room():
                self._mode = "content"
                return
            out.add_call(self.num_calls, *call)
            self.num_calls += 1
            self._buf = self._buf[end:]


class NamedCallParser(ToolParser):
    """The reply is the named function's arguments object (a grammar made sure)."""

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self.name = name

    def _header(self, out: ToolDelta) -> None:
        if self.num_calls == 0:
            out.add_call(0, self.name, "")
            self.num_calls = 1

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if text:
            self._header(out)
            out.calls = (out.calls or []) + [ToolCallDelta(0, None, text)]
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._header(out)
        return out


class RequiredCallsParser(ToolParser):
    """The reply is a JSON array of {"name", "parameters"} (a grammar made sure); each call is
    reported when its object closes."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._started = False  # past the "["

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolDelta:
        out = self._run(final=True)
        rest = self._buf.strip()
        if rest not in ("", "]"):  # cut short (max_tokens): shown as it is
            out.content += rest
        self._buf = ""
        return out

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            self._buf = self._buf.lstrip()
            if not self._started:
                if not self._buf.startswith("["):
                    return out
                self._buf, self._started = self._buf[1:], True
                continue
            self._buf = self._buf.removeprefix(",").lstrip()
            if not self._buf.startswith("{"):
                return out
            try:
                value, end = _DECODER.raw_decode(self._buf)
            except ValueError:
                return out
            call = _as_call(value, ("parameters", "arguments"))
            if call is None:
                return out
            self._buf = self._buf[end:]
            if self._room():
                out.add_call(self.num_calls, *call)
                self.num_calls += 1


def make_tool_parser(name: str, max_calls: int | None = None) -> ToolParser:
    if name in ("hermes", "qwen25"):
        return HermesParser(max_calls)
    if name == "llama3_json":
        return Llama3JsonParser(max_calls)
    raise ValueError(f"tool_call_parser: unknown parser {name!r}; use one of {TOOL_CALL_PARSERS}")


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """`--tool-call-parser auto`: hermes when the template writes <tool_call> blocks, llama3_json
    when it names <|python_tag|>; None when neither (or both) appear."""
    if not chat_template:
        return None
    hermes = HERMES_START in chat_template
    llama = PYTHON_TAG in chat_template
    if hermes == llama:
        return None
    return "hermes" if hermes else "llama3_json"
