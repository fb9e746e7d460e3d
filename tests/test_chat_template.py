"""Chat templates with the real Qwen3 tokenizer and template, against transformers' own
rendering; the request fields that become tools, constraints and parsers."""

from __future__ import annotations

import json

import pytest

from minisgl.chat import ChatPrompt, ChatSettings, prepare_chat
from minisgl.chat.reasoning import Mode
from minisgl.chat.requests import constraint_from_fields, plan_tools
from minisgl.chat.template import apply_chat_template, render_chat
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.limits import InvalidRequestError
from minisgl.tokenizer import load_tokenizer
from tests.conftest import qwen3_tokenizer_dir

THINK_END_ID = 151668
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
# An OpenAI-shaped tool conversation: arguments are JSON text, tool results carry their call id.
OPENAI_CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "15 C"}]},
]


def hf_messages() -> list[dict]:
    """The same conversation the way transformers documents it: arguments as objects, content
    as strings."""
    messages = json.loads(json.dumps(OPENAI_CONVERSATION))
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    messages[2]["content"] = ""
    messages[4]["content"] = "15 C"
    return messages


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(qwen3_tokenizer_dir())


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_tools_and_tool_results_render_as_transformers_does(tokenizer, kwargs) -> None:
    ours = render_chat(tokenizer, OPENAI_CONVERSATION, TOOLS, template_kwargs=kwargs)
    theirs = tokenizer.apply_chat_template(
        hf_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
    assert "<tool_response>\n21 C\n</tool_response>" in ours and '"name": "get_time"' in ours
    ids = apply_chat_template(tokenizer, OPENAI_CONVERSATION, TOOLS, template_kwargs=kwargs)
    encoded = tokenizer.apply_chat_template(
        hf_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=True, **kwargs
    )
    assert ids == list(encoded["input_ids"])


def test_enable_thinking_and_reasoning_content_reach_the_template(tokenizer) -> None:
    user = [{"role": "user", "content": "hi"}]
    off = render_chat(tokenizer, user, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(tokenizer, user).endswith("<|im_start|>assistant\n")
    turn = [*user, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
    rendered = render_chat(tokenizer, [*turn, {"role": "user", "content": "bye"}])
    theirs = tokenizer.apply_chat_template(
        [*turn, {"role": "user", "content": "bye"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == theirs
    last = render_chat(tokenizer, turn)  # the last assistant turn keeps its reasoning
    assert "<think>\nGreet.\n</think>\n\nHello!" in last


def test_a_custom_template_replaces_the_checkpoint_one(tokenizer, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ x }}")
    settings = ChatSettings.resolve(tokenizer, str(path), '{"x": "!"}')
    prepared = prepare_chat(tokenizer, settings, ChatPrompt([{"role": "user", "content": "hey"}]))
    assert tokenizer.decode(prepared.prompt_ids) == "[user|hey]!"
    hey = ChatPrompt([{"role": "user", "content": "hey"}], template_kwargs={"x": "?"})
    override = prepare_chat(tokenizer, settings, hey)
    assert tokenizer.decode(override.prompt_ids) == "[user|hey]?"
    with pytest.raises(ValueError, match="cannot read"):
        ChatSettings.resolve(tokenizer, str(tmp_path / "missing.jinja"))


def test_auto_parsers_from_the_qwen3_template(tokenizer) -> None:
    settings = ChatSettings.resolve(tokenizer, reasoning_parser="auto", tool_call_parser="auto")
    assert settings.reasoning_parser == "qwen3" and settings.tool_call_parser == "hermes"


def test_reasoning_gates_the_grammar_unless_thinking_is_off(tokenizer) -> None:
    settings = ChatSettings(reasoning_parser="qwen3", tool_call_parser="hermes")
    user = [{"role": "user", "content": "hi"}]
    fields = {"response_format": {"type": "json_object"}}
    thinking = prepare_chat(tokenizer, settings, ChatPrompt(user), fields)
    assert thinking.reasoning_mode == Mode.MAYBE
    assert thinking.constraint is not None and thinking.constraint.start_after == (THINK_END_ID,)
    off = prepare_chat(
        tokenizer, settings, ChatPrompt(user, template_kwargs={"enable_thinking": False}), fields
    )
    assert off.reasoning_mode == Mode.CONTENT
    assert off.constraint is not None and off.constraint.start_after == ()
    unsplit = prepare_chat(tokenizer, settings, ChatPrompt(user, separate_reasoning=False), fields)
    # the model still thinks when the request keeps its reasoning in the content
    assert unsplit.reasoning_parser is None and unsplit.constraint is not None
    assert unsplit.constraint.start_after == (THINK_END_ID,)
    with pytest.raises(InvalidRequestError, match="return_dict") as info:
        prepare_chat(tokenizer, settings, ChatPrompt(user, template_kwargs={"return_dict": True}))
    assert info.value.param == "chat_template_kwargs"


def test_tool_plans() -> None:
    auto = plan_tools(TOOLS, None, True)  # a parser fits the template: the model writes freely
    assert auto.mode == "auto" and auto.template_tools == TOOLS and auto.constraint is None
    assert plan_tools(TOOLS, "none", True).template_tools is None
    assert plan_tools([], None, True) == plan_tools(None, None, True)  # [] is no tools
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True)
    assert named.mode == "named" and named.constraint is not None
    assert json.loads(named.constraint.value) == WEATHER
    required = plan_tools(TOOLS, "required", False)
    assert required.constraint is not None and required.max_calls == 1
    schema = json.loads(required.constraint.value)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]


def test_auto_in_the_default_format_checks_every_call_block(tokenizer) -> None:
    """No parser fits: text stays free, a `<tool_call>` block must be a call of a tool with
    arguments its schema accepts (checked on xgrammar's matcher, token by token)."""
    import xgrammar as xgr

    plan = plan_tools(TOOLS, None, False, default_format=True)
    assert plan.constraint is not None and plan.constraint.kind == "structural_tag"
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = compiler.compile(plan.constraint)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return all(matcher.accept_token(i) for i in ids)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts("It is sunny.") and accepts(call) and accepts("Let me look. " + call)
    assert not accepts('<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": 1}}')
    assert not accepts(call + call)  # parallel_tool_calls false: one call, then the end


def test_a_template_without_tools_gets_them_described(tokenizer, tmp_path) -> None:
    """A template that never mentions tools (SmolLM2's kind): the default format. The tools go
    in the system message, the earlier call and its result are written as hermes blocks, and
    the reply is parsed as hermes under the call grammar."""
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}")
    settings = ChatSettings.resolve(tokenizer, str(path), tool_call_parser="auto")
    assert settings.tool_call_parser is None and settings.describe_tools
    prepared = prepare_chat(tokenizer, settings, ChatPrompt(OPENAI_CONVERSATION, TOOLS))
    text = tokenizer.decode(prepared.prompt_ids)
    system = text[: text.index("[user|")]
    assert system.startswith("[system|You are helpful.\n\n") and json.dumps(TOOLS[0]) in system
    assert '[assistant|<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "[user|<tool_response>\n" in text and "[tool|" not in text
    assert prepared.constraint is not None and prepared.constraint.kind == "structural_tag"
    reply = prepared.new_parser().feed(
        '<tool_call>\n{"name": "get_time"}\n</tool_call>', final=True
    )
    assert [(call.name, call.arguments) for call in reply.tool_calls] == [
        ("get_time", ""),
        (None, "{}"),
    ]
    # The request's own constraint wins over auto's call grammar.
    fields = {"response_format": {"type": "json_object"}}
    own = prepare_chat(tokenizer, settings, ChatPrompt(OPENAI_CONVERSATION, TOOLS), fields)
    assert own.constraint is not None and own.constraint.kind == "json_object"


@pytest.mark.parametrize(
    ("tools", "choice", "param", "fragment"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        (TOOLS, "sometimes", "tool_choice", "must be"),
        (None, "required", "tool_choice", "needs tools"),
        ([], "required", "tool_choice", "needs tools"),
        ([{"type": "function", "function": {}}], None, "tools", "no function name"),
        ([{"type": "function"}], None, "tools", "no 'function'"),
        ([{"type": "retrieval"}], None, "tools", "type 'function'"),
        ([TOOLS[0], TOOLS[0]], None, "tools", "twice"),
    ],
)
def test_bad_tools(tools, choice, param, fragment) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        plan_tools(tools, choice, True)
    assert info.value.param == param


def test_constraint_fields() -> None:
    assert constraint_from_fields({}) is None
    assert constraint_from_fields({"response_format": {"type": "text"}}) is None
    name, c = constraint_from_fields({"response_format": {"type": "json_object"}}) or ("", None)
    assert name == "response_format" and c is not None and c.kind == "json_object"
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}
    found = constraint_from_fields({"response_format": spec})
    assert found is not None and json.loads(found[1].value) == WEATHER
    found = constraint_from_fields({"guided_choice": ['say "hi"', "bye"]})
    assert found is not None and found[1].value == 'root ::= "say \\"hi\\"" | "bye"'
    found = constraint_from_fields({"structured_outputs": {"regex": "a+"}})
    assert found is not None and (found[1].kind, found[1].value) == ("regex", "a+")
    for fields, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            constraint_from_fields(fields)
        assert info.value.param == param, fields


def test_messages_are_checked(tokenizer) -> None:
    bad_call = [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    with pytest.raises(ValueError, match="function.name"):
        render_chat(tokenizer, bad_call)
    with pytest.raises(ValueError, match="only assistant"):
        render_chat(tokenizer, [{"role": "user", "content": "x", "tool_calls": []}])
    with pytest.raises(ValueError, match="tool_call_id must be a string"):
        render_chat(tokenizer, [{"role": "tool", "content": "x", "tool_call_id": 5}])
