"""Reasoning output: the text between `<think>` and `</think>` goes to `reasoning_content`.

An incremental parser over text deltas. It never emits part of a tag: a chunk ending in "<thi"
is held back until the next chunk shows whether a tag follows. The same machine produces the
non-streamed answer (fed the whole text at once), so streamed deltas joined always equal it.

Where the reply starts depends on the prompt (`initial_mode`):
- the template opened `<think>` itself (DeepSeek-R1, Qwen3 thinking-2507): reasoning from the
  first token, a leading `<think>` is still accepted;
- the template closed an empty think block (Qwen3 with `enable_thinking: false`): everything is
  content, tags included;
- otherwise (Qwen3): a reply starting with `<think>` reasons until `</think>`; any other reply
  is content. deepseek-r1 treats this case as reasoning, since R1 always thinks.

Whitespace around the reasoning is dropped: leading and trailing whitespace of the reasoning,
and the blank lines the model writes after `</think>` before its answer.

Reasoning also ends at an `implicit_end` tag, such as `<tool_call>` when Qwen3 calls a tool
before closing its thought; that tag stays in the content for the tool parser.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from minisgl.chat.streaming import find_first, partial_tag_len, split_trailing_space

REASONING_PARSERS = ("qwen3", "deepseek-r1")
THINK_START = "<think>"
THINK_END = "</think>"


class Mode(enum.Enum):
    MAYBE = "maybe"  # not yet known whether the reply opens with <think>
    REASONING = "reasoning"
    AFTER = "after"  # reasoning ended: content follows (its leading blank lines dropped)
    CONTENT = "content"  # no reasoning in this reply


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def initial_mode(parser: str, prompt_text: str) -> Mode:
    """Where the reply starts, from the rendered prompt's last think tags."""
    opened = prompt_text.rfind(THINK_START)
    closed = prompt_text.rfind(THINK_END)
    if opened > closed:
        return Mode.REASONING
    if closed >= 0 and not prompt_text[closed + len(THINK_END) :].strip():
        return Mode.CONTENT  # an empty think block closes the prompt: thinking is off
    return Mode.REASONING if parser == "deepseek-r1" else Mode.MAYBE


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """`--reasoning-parser auto`: the parser the chat template's think tags call for, or None
    when the template has none."""
    if not chat_template or THINK_START not in chat_template:
        return None
    # DeepSeek-R1's template writes its own role markers with full-width bars.
    return "deepseek-r1" if "<｜Assistant｜>" in chat_template else "qwen3"


class ReasoningParser:
    def __init__(self, mode: Mode, implicit_end: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.reasoned = mode == Mode.REASONING  # the reply had a reasoning part
        self._implicit_end = implicit_end
        self._buf = ""  # text not classified yet
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self.mode == Mode.CONTENT:
                content.append(self._buf)
                self._buf = ""
            elif self.mode == Mode.AFTER:
                stripped = self._buf.lstrip()
                self._buf = ""
                if stripped:
                    content.append(stripped)
                    self.mode = Mode.CONTENT
            elif self.mode == Mode.MAYBE:
                if not self._open(final):
                    break
            elif not self._reason(reasoning, final):
                break
        if final and self.mode == Mode.MAYBE:  # only whitespace or half a tag came
            self.mode = Mode.CONTENT
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _open(self, final: bool) -> bool:
        """MAYBE: decide from the reply's start. False: wait for more text."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf = head[len(THINK_START) :]
            self.mode, self.reasoned = Mode.REASONING, True
            return True
        if not final and THINK_START.startswith(head):  # "", "<", "<th", ...
            return False
        self.mode = Mode.CONTENT
        return True

    def _reason(self, out: list[str], final: bool) -> bool:
        """REASONING: emit reasoning text up to an end tag. False: wait for more text."""
        if not self._reasoning_started:
            head = self._buf.lstrip()
            # A template that opened <think> may still see the model write it (R1).
            if head.startswith(THINK_START):
                head = head[len(THINK_START) :].lstrip()
            elif not final and head and THINK_START.startswith(head):
                return False
            self._buf = head
            if not head:
                return False
            self._reasoning_started = True
        ends = (THINK_END, *self._implicit_end)
        at, tag = find_first(self._buf, ends)
        if tag is not None:
            out.append(self._buf[:at].rstrip())
            # The end tag is consumed; an implicit end (a tool call) stays for the content.
            self._buf = self._buf[at + len(tag) :] if tag == THINK_END else self._buf[at:]
            self.mode = Mode.AFTER
            return True
        if final:
            out.append(self._buf.rstrip())
            self._buf = ""
            return False
        hold = partial_tag_len(self._buf, ends)
        ready, space = split_trailing_space(self._buf[: len(self._buf) - hold])
        out.append(ready)
        self._buf = space + self._buf[len(self._buf) - hold :]
        return False
