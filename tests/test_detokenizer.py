"""IncrementalDetokenizer: multi-byte characters, stop strings, hold-back, equality with decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer
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
    keep = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), skip_special_tokens=False)
    assert ("".join(_stream(keep, ids)) + keep.flush()).endswith(tokenizer.eos_token)


def test_stop_spanning_tokens(tokenizer):
    text = "The answer is forty-two. END OF STORY and more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["END OF STORY"])
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
        tokenizer, _prompt(tokenizer), stop=["END OF STORY", "nothing"], include_stop=True
    )
    joined = "".join(_stream(detok, ids)) + detok.flush()
    assert detok.stopped and detok.stop_str == "END OF STORY"
    assert joined == detok.text == "The answer is forty-two. END OF STORY"


def test_stop_at_the_very_start(tokenizer):
    ids = tokenizer.encode("STOP right here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["STOP"])
    deltas = _stream(detok, ids)
    assert detok.stopped
    assert "".join(deltas) == "" == detok.text


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["four", "two"])
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and detok.stop_str == "two" and joined == "one "


def test_min_tokens_defers_stop_strings(tokenizer):
    """The first min_tokens tokens' text is shown as is; a stop string counts only after."""
    text = "stop here, then stop again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_len = len(tokenizer.encode("stop here,", add_special_tokens=False))
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), stop=["stop"], min_tokens=first_len
    )
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and joined == "stop here, then "
    assert IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["stop"]).add(ids) == ""


def test_hold_back_released_on_flush(tokenizer):
    # "END O" could be the start of the stop string: held back until the request ends.
    ids = tokenizer.encode("Almost the END O", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["END OF STORY"])
    streamed = "".join(_stream(detok, ids))
    assert streamed == "Almost the "
    assert detok.flush() == "END O"
    assert detok.text == "Almost the END O" and not detok.stopped


def test_hold_back_released_when_text_diverges(tokenizer):
    ids = tokenizer.encode("an ENDless road", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["END."])
    joined = "".join(_stream(detok, ids)) + detok.flush()
    assert joined == "an ENDless road" and not detok.stopped


def test_stop_inside_multibyte_text(tokenizer):
    ids = tokenizer.encode("你好，世界！再见", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["世界"])
    joined = "".join(_stream(detok, ids))
    assert detok.stopped and joined == "你好，"


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
