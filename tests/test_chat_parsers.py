"""Reasoning and tool-call parsers on scripted replies, split at every chunk boundary.

The oracle: the non-streamed answer (the whole reply fed at once) is what the request means,
and every way of streaming it must give the same answer when its deltas are joined, without
ever showing part of a tag.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from minisgl.chat.output import ChatDelta, ChatOutputParser
from minisgl.chat.reasoning import Mode, ReasoningParser, detect_reasoning_parser, initial_mode
from minisgl.chat.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    RequiredCallsParser,
    detect_tool_call_parser,
)

NUM_RANDOM_SPLITS = 20
TAG_FRAGMENTS = ("<think", "</think", "<tool_call", "</tool_call", "think>", "tool_call>")

MakeParser = Callable[[], ChatOutputParser]


def _joined(parser: ChatOutputParser, chunks: list[str]) -> tuple[dict, list[ChatDelta]]:
    # The last chunk ends the reply, as a request's last output does (the splits include an
    # empty last chunk: the end arriving on its own).
    *body, last = chunks or [""]
    deltas = [parser.feed(chunk, num_tokens=1) for chunk in body]
    deltas.append(parser.feed(last, num_tokens=1, final=True))
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in calls, "a call's header came twice"
                assert call.arguments == ""
                calls[call.index] = [call.name, ""]
            else:
                calls[call.index][1] += call.arguments
    answer = {
        "reasoning": "".join(d.reasoning for d in deltas),
        "content": "".join(d.content for d in deltas),
        "calls": [tuple(calls[i]) for i in sorted(calls)],
    }
    return answer, deltas


def _splits(text: str) -> list[list[str]]:
    """Two chunks at every boundary, one character per chunk, and random multi-splits."""
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    ways.append(list(text))
    rng = random.Random(0)
    for _ in range(NUM_RANDOM_SPLITS):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def check_every_split(make: MakeParser, text: str, expected: dict) -> None:
    whole, _ = _joined(make(), [text])
    assert whole == expected
    for chunks in _splits(text):
        answer, deltas = _joined(make(), chunks)
        assert answer == whole, chunks
        for delta in deltas:  # no tag, whole or partial, shows unless the answer has it
            for fragment in TAG_FRAGMENTS:
                for part in (delta.reasoning, delta.content):
                    if fragment in part:
                        assert fragment in whole["content"] + whole["reasoning"], chunks


def reasoning_only(mode: Mode, implicit_end: tuple[str, ...] = ()) -> MakeParser:
    return lambda: ChatOutputParser(ReasoningParser(mode, implicit_end), None)


def answer(reasoning: str = "", content: str = "", calls: list | None = None) -> dict:
    return {"reasoning": reasoning, "content": content, "calls": calls or []}


@pytest.mark.parametrize(
    ("mode", "text", "expected"),
    [
        (
            Mode.MAYBE,
            "<think>\nLet me think: 2+2.\n</think>\n\nThe answer is 4.",
            answer("Let me think: 2+2.", "The answer is 4."),
        ),
        # the template opened <think> itself
        (Mode.REASONING, "Okay, so.\n</think>\n\nFour.", answer("Okay, so.", "Four.")),
        # thinking disabled: tags the model writes anyway are content
        (Mode.CONTENT, "Hi <think>x</think> there", answer("", "Hi <think>x</think> there")),
        # cut by max_tokens inside the reasoning
        (Mode.MAYBE, "<think>\nI am still thin", answer("I am still thin")),
        # no think block at all
        (Mode.MAYBE, "  Plain <b>bold</b> reply\n", answer("", "  Plain <b>bold</b> reply\n")),
        # unicode on both sides (multi-byte characters next to the tags)
        (Mode.MAYBE, "<think>日本語 🙂</think>答え🙂 é", answer("日本語 🙂", "答え🙂 é")),
        # deepseek-r1: the model writes <think> although the template opened it
        (Mode.REASONING, "<think>\nr1 thinks\n</think>answer", answer("r1 thinks", "answer")),
        (Mode.MAYBE, "<think></think>\n\nempty thought", answer("", "empty thought")),
        (Mode.REASONING, "< not a tag </think> ok", answer("< not a tag", "ok")),
    ],
)
def test_reasoning_every_split(mode: Mode, text: str, expected: dict) -> None:
    check_every_split(reasoning_only(mode), text, expected)


def test_tool_call_inside_reasoning_ends_it() -> None:
    text = (
        '<think>\nI should look it up.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
        "</tool_call>"
    )
    make = lambda: ChatOutputParser(  # noqa: E731
        ReasoningParser(Mode.MAYBE, ("<tool_call>",)), HermesParser()
    )
    check_every_split(make, text, answer("I should look it up.", "", [("f", '{"x": 1}')]))


HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            HERMES_TWO,
            answer(
                content="Let me check.",
                calls=[("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")],
            ),
        ),
        # malformed: returned as content, unchanged
        (
            'Try <tool_call>\n{"name": broken}\n</tool_call> done',
            answer(content='Try <tool_call>\n{"name": broken}\n</tool_call> done'),
        ),
        # not a call object (no name)
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            answer(content='<tool_call>{"arguments": {}}</tool_call>'),
        ),
        # unclosed at the end but complete: still a call
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}',
            answer(calls=[("f", '{"a": [1, 2]}')]),
        ),
        # cut inside a block: content as written
        ('<tool_call>\n{"name": "f", "argu', answer(content='<tool_call>\n{"name": "f", "argu')),
        ("Cut right at <tool_call>", answer(content="Cut right at <tool_call>")),
        ("No tools needed < here.", answer(content="No tools needed < here.")),
    ],
)
def test_hermes_every_split(text: str, expected: dict) -> None:
    check_every_split(lambda: ChatOutputParser(None, HermesParser()), text, expected)


def test_hermes_parallel_tool_calls_false_keeps_one_call() -> None:
    whole, _ = _joined(ChatOutputParser(None, HermesParser(max_calls=1)), [HERMES_TWO])
    assert whole["calls"] == [("get_weather", '{"city": "Zürich"}')]
    assert "get_time" in whole["content"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"name": "f", "parameters": {"a": "ü"}}; {"name": "g", "parameters": {}}',
            answer(calls=[("f", '{"a": "ü"}'), ("g", "{}")]),
        ),
        ('<|python_tag|>{"name": "f", "parameters": {}}', answer(calls=[("f", "{}")])),
        ("Hello there {not json}", answer(content="Hello there {not json}")),
        ('{"answer": 42}', answer(content='{"answer": 42}')),
        (
            '{"name": "f", "parameters": {"a": 1',
            answer(content='{"name": "f", "parameters": {"a": 1'),
        ),
    ],
)
def test_llama3_json_every_split(text: str, expected: dict) -> None:
    check_every_split(lambda: ChatOutputParser(None, Llama3JsonParser()), text, expected)


def test_required_and_named_every_split() -> None:
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"s": "]}"}}]'
    expected = answer(calls=[("f", '{"a": 1}'), ("g", '{"s": "]}"}')])
    check_every_split(lambda: ChatOutputParser(None, RequiredCallsParser()), text, expected)
    args = '{"city": "Paris", "days": [1, 2]}'
    check_every_split(
        lambda: ChatOutputParser(None, NamedCallParser("weather")),
        args,
        answer(calls=[("weather", args)]),
    )
    # named after reasoning: the arguments are what follows </think>
    make = lambda: ChatOutputParser(ReasoningParser(Mode.MAYBE), NamedCallParser("w"))  # noqa: E731
    check_every_split(make, "<think>hm</think>\n\n" + args, answer("hm", "", [("w", args)]))


def test_required_cut_short_shows_the_rest() -> None:
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "para'
    whole, _ = _joined(ChatOutputParser(None, RequiredCallsParser()), [text])
    assert whole["calls"] == [("f", "{}")]
    assert whole["content"] == '{"name": "g", "para'


def test_reasoning_tokens_count_the_thinking_part() -> None:
    parser = ChatOutputParser(ReasoningParser(Mode.MAYBE), None)
    for piece in ["<think>", "a", " b", "</think>", "\n\n", "c", " d", " e"]:
        parser.feed(piece, num_tokens=1)
    parser.feed("", final=True)
    assert parser.reasoning_tokens == 4


def test_initial_mode_from_the_prompt() -> None:
    assert initial_mode("qwen3", "<|im_start|>assistant\n") == Mode.MAYBE
    assert initial_mode("deepseek-r1", "<｜Assistant｜>") == Mode.REASONING
    assert initial_mode("qwen3", "<|im_start|>assistant\n<think>\n") == Mode.REASONING
    disabled = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert initial_mode("qwen3", disabled) == Mode.CONTENT
    history = "<think>\nx\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n"
    assert initial_mode("qwen3", history) == Mode.MAYBE


def test_auto_detection_from_templates() -> None:
    assert detect_reasoning_parser("{{ '<think>' }} ... </think>") == "qwen3"
    assert detect_reasoning_parser("<｜Assistant｜><think>\n") == "deepseek-r1"
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_tool_call_parser("<tool_call>\n{...}\n</tool_call>") == "hermes"
    assert detect_tool_call_parser("<|python_tag|>") == "llama3_json"
    assert detect_tool_call_parser("plain") is None
    assert json.loads(json.dumps({"ok": True}))
