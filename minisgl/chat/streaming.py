"""What the incremental parsers share: the delta they return, a text buffer fed chunk by chunk,
and holding back text that may start a tag."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl.tokenizer.detokenizer import partial_match_len


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position in the reply
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # argument text to append


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class TextParser:
    """Text deltas in, `ChatDelta`s out. Unclassified text waits in `_buf`; `_run` takes what it
    can, all of it when `final` (the non-streamed answer is the same machine fed all at once)."""

    _buf = ""

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        """`final`: the last text of the reply; whatever is still held comes out."""
        self._buf += text
        return self._run(final)

    def _run(self, final: bool) -> ChatDelta:
        raise NotImplementedError


def hold_back(text: str, tags: Sequence[str], final: bool = False) -> tuple[str, str]:
    """(text safe to show, text held): held is a suffix that may start one of `tags` (the next
    chunk may complete it) and the whitespace before it, which belongs to whatever follows.
    Nothing is held when `final`."""
    if final:
        return text, ""
    ready = text[: len(text) - partial_match_len(text, tags)].rstrip()
    return ready, text[len(ready) :]
