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
from typing import Any

import minisgl.chat.jsontext as jsontext
from minisgl.chat.streaming import ChatDelta, TextParser, ToolCallDelta, hold_back

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _as_call(value: Any, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[key] for key in arg_keys if key in value), {})
    if not isinstance(arguments, dict) or not value["name"]:
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolParser(TextParser):
    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.num_calls = 0

    def _room(self) -> bool:
        return self.max_calls is None or self.num_calls < self.max_calls

    def _add_call(self, out: ChatDelta, name: str, arguments: str) -> None:
        """The next call: its header (name, empty arguments), then any argument text."""
        out.tool_calls.append(ToolCallDelta(self.num_calls, name))
        if arguments:
            out.tool_calls.append(ToolCallDelta(self.num_calls, None, arguments))
        self.num_calls += 1


class HermesParser(ToolParser):
    _inside = False  # between <tool_call> and </tool_call>
    _after_block = False  # whitespace right after a block is not content
    _space = ""  # whitespace before the open block: content again if it is malformed

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
        while self._buf or (final and self._inside):  # a reply may end right after the tag
            if self._inside:
                if HERMES_END not in self._buf and not final:
                    break
                body, closing, self._buf = self._buf.partition(HERMES_END)
                self._inside = False
                self._block(out, body, closing)
            elif self._after_block:
                self._buf = self._buf.lstrip()
                self._after_block = not self._buf
            else:
                at = self._buf.find(HERMES_START)
                if at < 0 or not self._room():
                    ready, self._buf = hold_back(self._buf, (HERMES_START,), final or at >= 0)
                    out.content += ready
                    break
                before = self._buf[:at].rstrip()
                out.content += before
                self._space = self._buf[len(before) : at]
                self._buf = self._buf[at + len(HERMES_START) :]
                self._inside = True
        return out

    def _block(self, out: ChatDelta, body: str, closing: str) -> None:
        """A whole block (or, at the end, an unclosed one): a call, or content as written."""
        call = _as_call(jsontext.loads_object(body), ("arguments", "parameters"))
        if call is None:
            out.content += self._space + HERMES_START + body + closing
            return
        self._add_call(out, *call)
        self._after_block = True


class Llama3JsonParser(ToolParser):
    _mode = "start"  # start -> calls | content

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
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

    def _calls(self, out: ChatDelta, final: bool) -> None:
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
            self._add_call(out, *call)
            self._buf = self._buf[end:]


class NamedCallParser(ToolParser):
    """The reply is the named function's arguments object (a grammar made sure)."""

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self.name = name

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self.num_calls == 0 and (self._buf or final):
            self._add_call(out, self.name, self._buf)
        elif self._buf:
            out.tool_calls.append(ToolCallDelta(0, None, self._buf))
        self._buf = ""
        return out


class RequiredCallsParser(ToolParser):
    """The reply is a JSON array of {"name", "parameters"} (a grammar made sure); each call is
    reported when its object closes."""

    _started = False  # past the "["

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        out = super().feed(text, final)
        rest = self._buf.strip()
        if final and rest not in ("", "]"):  # cut short (max_tokens): shown as it is
            out.content += rest
            self._buf = ""
        return out

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
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
            if (call := _as_call(value, ("parameters", "arguments"))) is None:
                return out
            self._buf = self._buf[end:]
            if self._room():
                self._add_call(out, *call)


# The parser each --tool-call-parser names (qwen25 writes hermes blocks).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """`--tool-call-parser auto`: hermes when the template writes <tool_call> blocks, llama3_json
    when it names <|python_tag|>; None when neither (or both) appear."""
    template = chat_template or ""
    hermes, llama = HERMES_START in template, PYTHON_TAG in template
    if hermes == llama:
        return None
    return "hermes" if hermes else "llama3_json"
