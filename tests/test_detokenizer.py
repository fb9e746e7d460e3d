"""IncrementalDetokenizer: multi-byte characters, stop strings, hold-back, equality with decode;
one request's outputs, its hidden final token and what matched."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.chat.template import apply_chat_template
from minisgl.core import FinishReason, ReqOutput, SamplingParams, TokenLogprob, finish_reason
from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer
from minisgl.tokenizer.detokenizer import stop_reason
from tests.conftest import qwen3_tokenizer_dir

REPLACEMENT_CHAR = "\ufffd"
SPLIT_EMOJI = "\U0001fae0"  # 🫠: three byte tokens in SmolLM2's and in Qwen3's vocabulary
SAMPLE_TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "héllo 😀 你好，世界！ 🎉🎉 naïve café — ok",
    "日本語のテキストと絵文字 👩‍👩‍👧‍👦 mixed with English words.",
    "  leading spaces and\nnew lines\n\n  tabs\tend",
]


@pytest.fixture(scope="module", params=["qwen3", "smollm2"])
def tokenizer(request, default_model_dir: Path):
    """Both tokenizers are part of the test setup: a missing one fails, it is never skipped."""
    return load_tokenizer(qwen3_tokenizer_dir() if request.param == "qwen3" else default_model_dir)


def _prompt(tokenizer) -> list[int]:
    return apply_chat_template(tokenizer, [{"role": "user", "content": "Say something."}])


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    return [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    deltas = _stream(detok, ids)
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    # A character split across tokens is held back, never shown as U+FFFD.
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert not detok.stopped


def test_multibyte_split_across_tokens_is_held(tokenizer):
    # An emoji both vocabularies split into byte tokens (😀 is a single token in Qwen3's)
    ids = tokenizer.encode(SPLIT_EMOJI, add_special_tokens=False)
    assert len(ids) >= 2, ids
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == SPLIT_EMOJI


def test_chunked_feeding_matches(tokenizer):
    text = SAMPLE_TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    joined = "".join(_stream(detok, ids, step=3)) + detok.flush()
    assert joined == tokenizer.decode(ids)


def test_special_tokens_skipped(tokenizer):
    eos_id = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [eos_id]
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert "".join(_stream(detok, ids)) + detok.flush() == "Hi there"
    keep = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), SamplingParams(skip_special_tokens=False)
    )
    assert ("".join(_stream(keep, ids)) + keep.flush()).endswith(tokenizer.eos_token)


def test_stop_spanning_tokens(tokenizer):
    text = "The answer is forty-two. END OF STORY and more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), SamplingParams(stop=["END OF STORY"])
    )
    deltas = []
    for token_id in ids:
        deltas.append(detok.add([token_id]))
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_str == "END OF STORY"
    assert "".join(deltas) == detok.text == "The answer is forty-two. "
    assert all("END" not in d for d in deltas)
    assert detok.add(ids[-1:]) == "" and detok.flush() == ""


def test_stop_string_kept_when_asked(tokenizer):
    """include_stop (vLLM's include_stop_str_in_output, SGLang's no_stop_trim): the text ends
    with the stop string, however the tokens split it, and nothing after it shows."""
    text = "The answer is forty-two. END OF STORY and more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer,
        _prompt(tokenizer),
        SamplingParams(stop=["END OF STORY", "nothing"], include_stop_str_in_output=True),
    )
    joined = "".join(_stream(detok, ids)) + detok.flush()
    assert detok.stopped and detok.stop_str == "END OF STORY"
    assert joined == detok.text == "The answer is forty-two. END OF STORY"


def test_stop_at_the_very_start(tokenizer):
    ids = tokenizer.encode("STOP right here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), SamplingParams(stop=["STOP"]))
    deltas = _stream(detok, ids)
    assert detok.stopped
    assert "".join(deltas) == "" == detok.text


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), SamplingParams(stop=["four", "two"])
    )
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and detok.stop_str == "two" and joined == "one "


def test_min_tokens_defers_stop_strings(tokenizer):
    """The first min_tokens tokens' text is shown as is; a stop string counts only after."""
    text = "stop here, then stop again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_len = len(tokenizer.encode("stop here,", add_special_tokens=False))
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), SamplingParams(stop=["stop"], min_tokens=first_len)
    )
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and joined == "stop here, then "
    assert (
        IncrementalDetokenizer(tokenizer, _prompt(tokenizer), SamplingParams(stop=["stop"])).add(
            ids
        )
        == ""
    )


def test_hold_back_released_on_flush(tokenizer):
    # "END O" could be the start of the stop string: held back until the request ends.
    ids = tokenizer.encode("Almost the END O", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), SamplingParams(stop=["END OF STORY"])
    )
    streamed = "".join(_stream(detok, ids))
    assert streamed == "Almost the "
    assert detok.flush() == "END O"
    assert detok.text == "Almost the END O" and not detok.stopped


def test_hold_back_released_when_text_diverges(tokenizer):
    ids = tokenizer.encode("an ENDless road", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), SamplingParams(stop=["END."]))
    joined = "".join(_stream(detok, ids)) + detok.flush()
    assert joined == "an ENDless road" and not detok.stopped


def test_stop_inside_multibyte_text(tokenizer):
    ids = tokenizer.encode("你好，世界！再见", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), SamplingParams(stop=["世界"]))
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and joined == "你好，"


# ---- one request's outputs -------------------------------------------------------------------


def _outputs(ids: list[int], finish: FinishReason | None, rid: str = "r") -> list[ReqOutput]:
    """One output per token, as the scheduler sends them; the last carries `finish` (a STOP's
    token, an EOS or stop token id, as what matched, not shown)."""
    outputs = [
        ReqOutput(rid, (token_id,), logprobs=(TokenLogprob(token_id, -1.0, ()),))
        for token_id in ids
    ]
    last = outputs[-1]
    last.finish_reason = finish
    if finish == FinishReason.STOP:
        last.token_ids, last.matched_stop = (), ids[-1]
    return outputs


@pytest.mark.parametrize("incremental", [True, False])
def test_final_eos_is_counted_but_not_shown(tokenizer, incremental):
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    params = SamplingParams(skip_special_tokens=False)  # even as text, the final EOS is hidden
    assert finish_reason(params, eos, len(ids) + 1, eos_token_ids=(eos,)) == FinishReason.STOP
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), params, incremental)
    outputs = _outputs([*ids, eos], FinishReason.STOP)
    assert all([detok.add_output(out) for out in outputs]) and detok.done
    assert "".join(out.text for out in outputs) == "Hi there"
    last = outputs[-1]
    # ...but it was generated: its logprob is reported (lm-eval's scoring reads it)
    assert last.token_ids == () and len(last.logprobs) == 1 and last.num_new_tokens == 1
    assert last.logprobs[0].token_id == eos
    assert last.finish_reason == FinishReason.STOP and last.matched_stop == eos
    assert stop_reason(params, last.matched_stop) is None  # vLLM: EOS is no stop_reason
    # ignore_eos: an EOS that ends nothing is an ordinary token
    kept_params = SamplingParams(ignore_eos=True)
    assert finish_reason(kept_params, eos, len(ids) + 1, eos_token_ids=(eos,)) is None
    kept = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), kept_params, incremental)
    ending = _outputs([*ids, eos], FinishReason.LENGTH)
    assert all([kept.add_output(out) for out in ending])
    assert ending[-1].token_ids == (eos,) and ending[-1].matched_stop is None


def test_stop_token_id_is_matched_and_hidden(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    params = SamplingParams(stop_token_ids=(ids[-1],))
    assert finish_reason(params, ids[-1], len(ids)) == FinishReason.STOP
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), params)
    outputs = _outputs(ids, FinishReason.STOP)
    assert all([detok.add_output(out) for out in outputs])
    assert "".join(out.text for out in outputs) == tokenizer.decode(ids[:-1])
    assert outputs[-1].matched_stop == ids[-1]
    assert stop_reason(params, ids[-1]) == ids[-1]


def test_stop_string_ends_it_and_drops_what_follows(tokenizer):
    """A stop string ends the request at once (asking the scheduler to abort it); the outputs
    the scheduler still sends for it, up to its own end, are dropped."""
    ids = tokenizer.encode("The answer is 42. END and then more", add_special_tokens=False)
    params = SamplingParams(stop=("END",))
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), params)
    outputs = _outputs(ids, FinishReason.ABORT)
    shown, to_abort = [], []
    for out in outputs:
        if detok.add_output(out):
            shown.append(out)
            if out.finish_reason is not None and not detok.done:  # the scheduler still runs it
                to_abort.append(out)
    ended = [out for out in shown if out.finish_reason is not None]
    assert len(ended) == 1 and ended[0] is shown[-1]  # exactly one terminal event, the last
    first = ended[0]
    assert to_abort == [first] and first.matched_stop == "END"
    assert first.finish_reason == FinishReason.STOP
    assert "".join(out.text for out in shown) == "The answer is 42. "
    assert len(shown) < len(outputs) and detok.done  # the rest dropped, up to the scheduler's end
    assert stop_reason(params, "END") == "END"


def test_stop_string_in_the_final_output_needs_no_abort(tokenizer):
    ids = tokenizer.encode("stop here", add_special_tokens=False)
    params = SamplingParams(stop=("here",))
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), params)
    out = ReqOutput("r", tuple(ids), finish_reason=FinishReason.LENGTH)
    assert detok.add_output(out) and detok.done  # done: the scheduler ended it, nothing to abort
    assert (out.finish_reason, out.matched_stop, out.text) == (FinishReason.STOP, "here", "stop ")


def test_offline_text_is_decoded_once_at_the_end(tokenizer):
    text = SAMPLE_TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), SamplingParams(), False)
    outputs = _outputs(ids, FinishReason.LENGTH)
    assert all([detok.add_output(out) for out in outputs])
    assert [out.text for out in outputs[:-1]] == [""] * (len(ids) - 1)
    assert outputs[-1].text == tokenizer.decode(ids)


# ---- chat templates ------------------------------------------------------------------------


def test_chat_template_accepts_text_parts(tokenizer):
    plain = apply_chat_template(tokenizer, [{"role": "user", "content": "Hello there"}])
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert apply_chat_template(tokenizer, [{"role": "user", "content": parts}]) == plain
    assert all(isinstance(t, int) for t in plain)
    # add_generation_prompt: the prompt ends where the assistant's reply begins.
    assert tokenizer.decode(plain).rstrip().endswith("assistant")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "robot", "content": "hi"}],
        [{"content": "no role"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 42}],
        ["not a dict"],
    ],
)
def test_chat_template_rejects_bad_messages(tokenizer, messages):
    with pytest.raises(ValueError, match="^messages: "):
        apply_chat_template(tokenizer, messages)


def test_chat_template_missing(tokenizer):
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    finally:
        tokenizer.chat_template = saved
