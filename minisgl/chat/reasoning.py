"""Reasoning output: the text between `<think>` and `</think>` goes to `reasoning_content`.

An incremental parser that never emits part of a tag; fed the whole reply at once it gives the
non-streamed answer, which streamed deltas joined always equal. Whitespace around the reasoning
is dropped. An `implicit_end` tag (`<tool_call>`: Qwen3 may call a tool before closing its
thought) ends the reasoning too and stays in the content for the tool parser."""

import enum

from minisgl.chat.streaming import ChatDelta, TextParser, hold_back
from minisgl.tokenizer.detokenizer import find_first

THINK_START = "<think>"
THINK_END = "</think>"


class Mode(enum.Enum):
    MAYBE = "maybe"  # the reply's start: does it open with <think>?
    REASONING = "reasoning"
    CONTENT = "content"  # no reasoning in this reply, or the reasoning ended


def initial_mode(parser: str | None, prompt_text: str) -> Mode:
    """Where the reply starts, from the rendered prompt's last think tags: the template opened
    `<think>` (DeepSeek-R1, Qwen3 thinking-2507): reasoning; it closed an empty think block
    (`enable_thinking: false`): content; otherwise a reply that opens `<think>` reasons (and
    under deepseek-r1 any reply: R1 always thinks). No parser: content."""
    if parser is None:
        return Mode.CONTENT
    opened, closed = prompt_text.rfind(THINK_START), prompt_text.rfind(THINK_END)
    if opened > closed:
        return Mode.REASONING
    if closed >= 0 and not prompt_text[closed + len(THINK_END) :].strip():
        return Mode.CONTENT  # an empty think block closes the prompt: thinking is off
    return Mode.REASONING if parser == "deepseek-r1" else Mode.MAYBE


def detect_reasoning_parser(chat_template: str) -> str | None:
    """`--reasoning-parser auto`: the parser the chat template's think tags call for, or None
    when the template has none."""
    if THINK_START not in chat_template:
        return None
    # DeepSeek-R1's template writes its own role markers with full-width bars.
    return "deepseek-r1" if "<｜Assistant｜>" in chat_template else "qwen3"


class ReasoningParser(TextParser):
    def __init__(self, mode: Mode, implicit_end: tuple[str, ...] = ()) -> None:
        self.reasoned = mode == Mode.REASONING  # the reply has a reasoning part
        # Where the template opened <think>, the model may still write it (R1): MAYBE looks.
        self.mode = Mode.MAYBE if self.reasoned else mode
        self._ends = (THINK_END, *implicit_end)
        self._strip = False  # leading whitespace, of the reasoning or of the answer after it

    def _run(self, final: bool) -> ChatDelta:
        out = ChatDelta()
        while self._buf:
            if self._strip:
                self._buf = self._buf.lstrip()
                self._strip = not self._buf
            elif self.mode == Mode.CONTENT:
                out.content += self._buf
                self._buf = ""
            elif self.mode == Mode.MAYBE:
                if (opened := self._opens(final)) is None:
                    break
                self.reasoned = self._strip = self.reasoned or opened
                self.mode = Mode.REASONING if self.reasoned else Mode.CONTENT
            else:
                at, tag = find_first(self._buf, self._ends)
                if tag is None:
                    ready, self._buf = hold_back(self._buf, self._ends, final)
                    out.reasoning += ready.rstrip()  # at the end: trailing whitespace dropped
                    break
                out.reasoning += self._buf[:at].rstrip()
                # The end tag is consumed; an implicit end (a tool call) stays for the content.
                self._buf = self._buf[at + len(tag) :] if tag == THINK_END else self._buf[at:]
                self.mode, self._strip = Mode.CONTENT, True
        return out

    def _opens(self, final: bool) -> bool | None:
        """Whether the text opens with <think> (then consumed); None: not known yet."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf = head[len(THINK_START) :]
            return True
        if not final and THINK_START.startswith(head):  # "", "<", "<th", ...
            return None
        return False
