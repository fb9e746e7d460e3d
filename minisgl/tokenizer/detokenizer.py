"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level tokenizers: a multi-byte UTF-8 character
(emoji, CJK) can be split across tokens, and a lone token then decodes to U+FFFD. Like vLLM and
HF's TextStreamer we decode a small sliding window instead:

    ids:  ... | prefix_offset ........ read_offset ........ end |
                 already emitted text   |   new tokens

and emit `decode(prefix:end)[len(decode(prefix:read)):]` only once it no longer ends in U+FFFD.
The window starts inside the prompt so that tokenizers which drop a leading space when decoding
from the start of a sequence still get the space right.

Stop strings are matched on the decoded text. Text that could still be the start of a stop string
is held back until it can't (or until `flush`), so a stop string never leaks into any delta, even
when it spans several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the decoding window (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, stopping at stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        """min_tokens: the text of the first min_tokens output tokens is shown as it comes and
        never matched against the stop strings (vLLM's min_tokens). include_stop: the text ends
        with the stop string that ended it, instead of just before it."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._held = ""  # decoded but not yet emitted: it could be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text, if any
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._num_tokens = 0  # output tokens added so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output tokens; return the text that is now safe to show."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self._num_tokens += len(token_ids)
        self._held += self._decode_ready()
        # Before min_tokens, release everything unmatched: stops count only in later text.
        return self._release(final=False, match=self._num_tokens >= self._min_tokens)

    def flush(self) -> str:
        """The request ended for another reason: return everything still held back."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._held += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(
            list(ids),
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return cast(str, text)

    def _decode_ready(self) -> str:
        """Decode the window; return the new text unless it ends mid-character."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # wait for the rest of the character (or for visible text)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, final: bool, match: bool = True) -> str:
        held = self._held
        stop_at, stop_str = self._find_stop(held) if match else (len(held), None)
        if stop_str is not None:
            out = held[: stop_at + (len(stop_str) if self._include_stop else 0)]
            self.stopped, self.stop_str, self._held = True, stop_str, ""
        elif final:
            out, self._held = held, ""
        else:
            keep_len = self._partial_stop_len(held) if match else 0
            out, self._held = held[: len(held) - keep_len], held[len(held) - keep_len :]
        self.text += out
        return out

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        """Earliest stop string in `text`. Emitted text never holds one: it was held back."""
        best_at, best_stop = len(text), None
        for stop in self._stops:
            at = text.find(stop)
            if 0 <= at < best_at:
                best_at, best_stop = at, stop
        return best_at, best_stop

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
