"""Tool calls in the model's text -> OpenAI tool_calls, incrementally.

Each parser turns text deltas into content and call deltas (a call's first delta has its name
and no arguments; handlers add ids and the OpenAI shape); fed the whole reply at once it gives
the non-streamed answer. Under tool_choice "required" or a named function a grammar shapes the
reply (minisgl.chat.requests) and `RequiredCallsParser` / `NamedCallParser` read it."""

import json
from typing import Any

import minisgl.chat.jsontext as jsontext
from minisgl.chat.streaming import ChatDelta, TextParser, ToolCallDelta, hold_back

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _as_call(value: Any, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    arguments: Any = next((value[key] for key in arg_keys if key in value), {})
    return (
        (name, json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None
    )


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
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3,
    Hermes), text outside them content. A block is reported when it closes, so a malformed one
    is returned as content, unchanged."""

    _inside = False  # between <tool_call> and </tool_call>
    _after_block = False  # whitespace right after a block is not content
    _space = ""  # whitespace before the open block: content again if it is malformed

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
        while self._buf or (final and self._inside):  # a reply may end right after the tag
            if self._inside:
                if HERMES_END not in self._buf and not final:
                    break
                # A whole block (or, at the end, an unclosed one): a call, or content as written.
                body, closing, self._buf = self._buf.partition(HERMES_END)
                self._inside = False
                call = _as_call(jsontext.loads_object(body), ("arguments", "parameters"))
                if call is None:
                    out.content += self._space + HERMES_START + body + closing
                else:
                    self._add_call(out, *call)
                    self._after_block = True
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


class Llama3JsonParser(ToolParser):
    """Calls as JSON objects in a row: `{"name", "parameters"}` objects separated by `;`, after
    an optional <|python_tag|>. A reply that does not start with one is content, and so is what
    follows a call when it is not one."""

    opening, separator, closing = PYTHON_TAG, ";", ""
    _mode = "start"  # start -> calls | content

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self._mode == "start":
            head = self._buf.lstrip().removeprefix(self.opening).lstrip()
            if not final and (not head or self.opening.startswith(head)):
                return out
            if head.startswith("{"):
                self._mode, self._buf = "calls", head
            else:
                self._mode = "content"
        while self._mode == "calls":
            if self.num_calls > 0:  # between calls: a separator
                self._buf = self._buf.lstrip().removeprefix(self.separator).lstrip()
            try:
                value, end = _DECODER.raw_decode(self._buf)
            except ValueError:  # not whole yet; at the end, cut short or broken
                if final:
                    self._mode = "content"
                    if self._buf.strip() == self.closing:  # "]": the array's end
                        self._buf = ""
                break
            call = _as_call(value, ("parameters", "arguments"))
            if call is None or not self._room():
                self._mode = "content"
                break
            self._add_call(out, *call)
            self._buf = self._buf[end:]
        if self._mode == "content":
            out.content += self._buf
            self._buf = ""
        return out


class RequiredCallsParser(Llama3JsonParser):
    """The reply is a JSON array of {"name", "parameters"} (a grammar made sure); each call is
    reported when its object closes, and a reply cut short shows the rest as content."""

    opening, separator, closing = "[", ",", "]"


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


# The parser each --tool-call-parser names (qwen25 writes hermes blocks).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def detect_tool_call_parser(chat_template: str) -> str | None:
    """`--tool-call-parser auto`: hermes when the template writes <tool_call> blocks, llama3_json
    when it names <|python_tag|>; None when neither (or both) appear."""
    hermes, llama = HERMES_START in chat_template, PYTHON_TAG in chat_template
    if hermes == llama:
        return None
    return "hermes" if hermes else "llama3_json"
