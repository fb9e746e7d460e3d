"""Incremental detokenization with stop strings, for the server's detokenizer process and the
offline `LLM` alike: a request's outputs in, their text filled in, and the stop string that ends
it (minisgl.core.finish_reason). Text goes out only as whole characters, and no stop string
leaks into it (docs/architecture.md#incremental-detokenization)."""

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

from minisgl.core import ReqOutput, SamplingParams, finish_reason

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
    """One request's output tokens -> text deltas, stopping at its stop strings (min_tokens and
    include_stop_str_in_output included): for the server's detokenizer process and the offline
    `LLM` alike (`add_output`), or fed token ids directly (`add`, `flush`).

    `incremental=False` (offline) decodes the text once, at the end, when no stop string needs
    it earlier: decoding every token is a fair share of a fast step's host time.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        incremental: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._incremental = incremental or bool(params.stop)
        self._ids: list[int] = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)  # (not incremental: where the output starts)
        self._held = ""  # decoded but not yet emitted: it could be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stop_str: str | None = None  # the stop string that ended the text, if any
        self.num_tokens = 0  # output tokens added so far
        self.done = False  # the scheduler sent its last output for this request

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def add_output(self, output: ReqOutput) -> bool:
        """Fill in `output.text`. A stop string in it ends the request (finish_reason STOP,
        matched_stop the string): while not `done`, the caller aborts it in the scheduler.
        False: an output the scheduler sent after that (drop it)."""
        self.done = output.finish_reason is not None
        if self.stopped:  # by a stop string, in an earlier output
            return False
        if self._incremental:
            output.text = self.add(output.token_ids) + (self.flush() if self.done else "")
        else:
            self._ids += output.token_ids
            output.text = self._decode(self._ids[self._read_offset :]) if self.done else ""
        if self.stop_str is not None:
            reason = finish_reason(self._params, self.stop_str, self.num_tokens)
            output.finish_reason, output.matched_stop = reason, self.stop_str
            # A final EOS the scheduler saw in the same output never came: no logprob of it.
            output.logprobs = output.logprobs[: len(output.token_ids)]
        return True

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output tokens; return the text that is now safe to show."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self.num_tokens += len(token_ids)
        # Before min_tokens, release everything unmatched: stops count only in later text.
        return self._release(final=False, match=self.num_tokens >= self._params.min_tokens)

    def flush(self) -> str:
        """The request ended for another reason: return everything still held back."""
        return "" if self.stopped else self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        skip = self._params.skip_special_tokens
        text = self._tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
        return cast(str, text)

    def _release(self, final: bool, match: bool = True) -> str:
        """Decode the window; hold its new text back when it ends mid-character (until final),
        or when it may start a stop string; return the rest."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        incomplete = len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
        if final or not incomplete:  # else wait for the rest of the character (or visible text)
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._held += new_text[len(prefix_text) :]
        held, stops = self._held, self._params.stop
        # Emitted text never holds a stop string: it was held back.
        stop_at, stop_str = find_first(held, stops) if match else (-1, None)
        if stop_str is not None:
            include = self._params.include_stop_str_in_output
            out = held[: stop_at + (len(stop_str) if include else 0)]
            self.stop_str, self._held = stop_str, ""
        else:
            keep_len = partial_match_len(held, stops) if match and not final else 0
            out, self._held = held[: len(held) - keep_len], held[len(held) - keep_len :]
        self.text += out
        return out


def stop_reason(params: SamplingParams, matched_stop: int | str | None) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or the stop_token_ids entry that ended the output;
    None for EOS, length and the rest."""
    if isinstance(matched_stop, int) and matched_stop not in params.stop_token_ids:
        return None  # EOS
    return matched_stop
