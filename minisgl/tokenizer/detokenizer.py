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

`RequestDetokenizer` is one request's whole output rule, for the server's detokenizer process and
the offline `LLM` alike: the text above, plus the final EOS or stop token that ends the request
without showing in its text, and what matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from minisgl.core import FinishReason, ReqOutput, SamplingParams, TokenLogprob

# How many prompt tokens seed the decoding window (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def find_first(text: str, tags: Sequence[str]) -> tuple[int, str | None]:
    """(position, tag) of the earliest of `tags` in `text` (the first listed on a tie);
    (-1, None) when none occurs. Stop strings here, think and tool-call tags in minisgl.chat."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found, key=lambda match: match[0], default=(-1, None))


def partial_match_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text to
    hold back, because the next chunk may complete the tag."""
    longest = max((len(t) for t in tags), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-length:]
        if any(tag.startswith(suffix) for tag in tags):
            return length
    return 0


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
        # Before min_tokens, release everything unmatched: stops count only in later text.
        return self._release(final=False, match=self._num_tokens >= self._min_tokens)

    def flush(self) -> str:
        """The request ended for another reason: return everything still held back."""
        return "" if self.stopped else self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return cast(str, text)

    def _decode_new(self, final: bool) -> str:
        """Decode the window; return the new text unless it ends mid-character (until final)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        incomplete = len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
        if incomplete and not final:
            return ""  # wait for the rest of the character (or for visible text)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, final: bool, match: bool = True) -> str:
        held = self._held + self._decode_new(final)
        # Emitted text never holds a stop string: it was held back.
        stop_at, stop_str = find_first(held, self._stops) if match else (-1, None)
        if stop_str is not None:
            out = held[: stop_at + (len(stop_str) if self._include_stop else 0)]
            self.stopped, self.stop_str, self._held = True, stop_str, ""
        else:
            keep_len = partial_match_len(held, self._stops) if match and not final else 0
            out, self._held = held[: len(held) - keep_len], held[len(held) - keep_len :]
        self.text += out
        return out


@dataclass(frozen=True)
class TextDelta:
    """What one scheduler output adds to a request's text."""

    text: str  # safe to show: no partial character, no stop string
    token_ids: tuple[int, ...]  # the new tokens whose text shows (a hidden final one is not)
    logprobs: tuple[TokenLogprob, ...]  # theirs, and the hidden final token's
    finish_reason: FinishReason | None
    # What ended a STOP finish: the stop string, or the final token's id (EOS or a stop token).
    matched_stop: int | str | None = None
    abort: bool = False  # a stop string ended it before the scheduler did: abort it there


class RequestDetokenizer:
    """One request's outputs -> text deltas, its stop strings (min_tokens and
    include_stop_str_in_output included) and its hidden final EOS / stop token.

    `incremental=False` (offline) decodes the text once, at the end, when no stop string needs
    it earlier: decoding every token costs tens of microseconds, a fair share of a fast step.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        incremental: bool = True,
    ) -> None:
        eos_ids = () if params.ignore_eos else tuple(eos_token_ids)
        # A final token with one of these ids adds no text.
        self._hidden_final_ids = frozenset((*params.stop_token_ids, *eos_ids))
        self._tokenizer = tokenizer
        self._params = params
        self._incremental = incremental or bool(params.stop)
        self._text = IncrementalDetokenizer(
            tokenizer,
            prompt_ids,
            params.stop,
            params.skip_special_tokens,
            params.min_tokens,
            params.include_stop_str_in_output,
        )
        self._shown_ids: list[int] = []  # for the one decode at the end (not incremental)
        self.done = False  # the scheduler sent its last output for this request

    def add(self, output: ReqOutput) -> TextDelta | None:
        """None: an output the scheduler sent before the abort a stop string asked for."""
        finish = output.finish_reason
        self.done = finish is not None
        if self._text.stopped:  # by a stop string, in an earlier output
            return None
        token_ids = list(output.new_token_ids)
        matched: int | str | None = None
        # Stopped by EOS / a stop token id: that token counts as generated but shows no text.
        if finish == FinishReason.STOP and token_ids and token_ids[-1] in self._hidden_final_ids:
            matched = token_ids.pop()
        text = self._decode(token_ids, final=self.done)
        abort = self._text.stopped and finish is None
        # The hidden token keeps its logprob: scoring (lm-eval's echo + max_tokens 1) reads the
        # generated token's entry whatever it is.
        num_scored = len(token_ids) + (matched is not None and not self._text.stopped)
        if self._text.stopped:
            finish, matched = FinishReason.STOP, self._text.stop_str
        logprobs = output.new_logprobs[:num_scored]
        return TextDelta(text, tuple(token_ids), logprobs, finish, matched, abort)

    def _decode(self, token_ids: list[int], final: bool) -> str:
        if not self._incremental:
            self._shown_ids += token_ids
            if not final:
                return ""
            skip = self._params.skip_special_tokens
            return str(self._tokenizer.decode(self._shown_ids, skip_special_tokens=skip))
        text = self._text.add(token_ids)
        return text + self._text.flush() if final else text


def stop_reason(params: SamplingParams, matched_stop: int | str | None) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or the stop_token_ids entry that ended the output;
    None for EOS, length and the rest."""
    if isinstance(matched_stop, int) and matched_stop not in params.stop_token_ids:
        return None  # EOS
    return matched_stop
