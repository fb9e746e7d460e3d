"""A chat request, made ready to run: the prompt, its constraint and its reply parsers."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

import minisgl.chat.jsontext as jsontext
from minisgl.chat.output import ChatOutputParser
from minisgl.chat.reasoning import (
    THINK_END,
    Mode,
    ReasoningParser,
    detect_reasoning_parser,
    initial_mode,
)
from minisgl.chat.requests import ToolPlan, constraint_from_fields, plan_tools
from minisgl.chat.template import load_chat_template, render_chat
from minisgl.chat.tool_parsers import (
    HERMES_START,
    TOOL_PARSERS,
    HermesParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
    detect_tool_call_parser,
)
from minisgl.chat.tool_prompt import with_tools_described
from minisgl.core import Constraint
from minisgl.limits import InvalidRequestError

logger = logging.getLogger(__name__)


# apply_chat_template's own parameters (and `messages`, which it hands the template itself):
# not template variables, and passing one twice would change what the call returns
# (return_dict, tokenize) or fail.
_OWN_PARAMETERS = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
RESERVED_TEMPLATE_KWARGS = {*_OWN_PARAMETERS, "messages"} - {"self", "kwargs"}


def parse_template_kwargs(value: Any) -> dict[str, Any]:
    """A JSON object (text or dict) of chat template variables (chat_template_kwargs)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = jsontext.loads(value, "chat_template_kwargs", "must be a JSON object")
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError("chat_template_kwargs", "must be a JSON object")
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS.intersection(value)):
        raise InvalidRequestError("chat_template_kwargs", f"{reserved} cannot be set here")
    return dict(value)


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat options (--chat-template, --chat-template-kwargs, --reasoning-parser,
    --tool-call-parser, whose values ServerArgs checks), resolved once at start-up: `auto` parsers
    are picked here. No tool-call parser: minisgl's default format (`<tool_call>` blocks under a
    grammar, read as hermes)."""

    chat_template: str | None = None  # replaces the tokenizer's template when set
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    describe_tools: bool = False  # the template has no place for tools (chat/tool_prompt.py)

    @classmethod
    def resolve(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        chat_template_path: str | None = None,
        template_kwargs: Any = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
    ) -> ChatSettings:
        template = load_chat_template(chat_template_path) if chat_template_path else None
        source = template or getattr(tokenizer, "chat_template", None)
        source = source if isinstance(source, str) else ""
        if reasoning_parser == "auto":
            reasoning_parser = detect_reasoning_parser(source)
            logger.info("--reasoning-parser auto: %s", reasoning_parser or "none (no think tags)")
        if tool_call_parser == "auto":
            tool_call_parser = detect_tool_call_parser(source)
            found = tool_call_parser or "none fits the chat template, tools use the default format"
            logger.info("--tool-call-parser auto: %s", found)
        kwargs = parse_template_kwargs(template_kwargs)
        describe = tool_call_parser in (None, "hermes", "qwen25") and "tools" not in source
        return cls(template, kwargs, reasoning_parser, tool_call_parser, describe)


@dataclass(frozen=True)
class PreparedChat:
    prompt_ids: list[int]
    tools: ToolPlan
    tool_call_parser: str | None
    reasoning_parser: str | None  # None: reasoning stays in the content
    reasoning_mode: Mode
    constraint: Constraint | None
    constraint_param: str | None  # the request field the constraint came from

    def new_parser(self) -> ChatOutputParser:
        """A fresh parser for one choice's reply."""
        plan = self.tools
        tools: ToolParser | None = None
        if plan.function is not None:  # mode "named"
            tools = NamedCallParser(plan.function)
        elif plan.mode == "required":
            tools = RequiredCallsParser(plan.max_calls)
        elif plan.mode == "auto":
            tools = TOOL_PARSERS[self.tool_call_parser or "hermes"](plan.max_calls)
        reasoning = None
        if self.reasoning_parser is not None:
            # Qwen3 may call a tool before it closes its thought: <tool_call> ends reasoning too.
            implicit_end = (HERMES_START,) if isinstance(tools, HermesParser) else ()
            reasoning = ReasoningParser(self.reasoning_mode, implicit_end)
        return ChatOutputParser(reasoning, tools)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the chat template, as a request gives it."""

    messages: Any
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang: false keeps the reasoning inside the content


def prompt_texts(prompt: ChatPrompt | list[str] | list[list[int]]) -> tuple[list[str], int]:
    """(the prompt's text: a chat's message contents, string or text parts; the number of chat
    messages): what any template renders at least, known before rendering."""
    if not isinstance(prompt, ChatPrompt):
        return [p for p in prompt if isinstance(p, str)], 0
    messages = prompt.messages or []  # (a list: the request's schema says so)
    contents = [m.get("content") for m in messages if isinstance(m, Mapping)]
    parts = [p for c in contents if isinstance(c, list) for p in c if isinstance(p, Mapping)]
    texts = [t for t in [*contents, *(p.get("text") for p in parts)] if isinstance(t, str)]
    return texts, len(messages)


def with_reasoning_effort(
    kwargs: Mapping[str, Any] | None, effort: str | None
) -> Mapping[str, Any] | None:
    """Template variables with OpenAI's `reasoning_effort` (it reaches the template as vLLM
    passes it); "none" also turns a hybrid model's thinking off (Qwen3's enable_thinking)
    unless the request sets that itself."""
    if effort is None:
        return kwargs
    merged = {"reasoning_effort": effort, **(kwargs or {})}
    if effort == "none":
        merged.setdefault("enable_thinking", False)
    return merged


def prepare_chat(
    tokenizer: PreTrainedTokenizerBase,
    settings: ChatSettings,
    prompt: ChatPrompt,
    constraint_fields: Mapping[str, Any] | None = None,
) -> PreparedChat:
    """Raises InvalidRequestError (a field to blame) or ValueError (about `messages`)."""
    p, parser = prompt, settings.reasoning_parser
    plan = plan_tools(p.tools, p.tool_choice, p.parallel_tool_calls, not settings.tool_call_parser)
    kwargs = {**settings.template_kwargs, **parse_template_kwargs(p.template_kwargs)}
    messages, tools = p.messages, plan.template_tools
    if tools and settings.describe_tools:
        messages, tools = with_tools_described(messages, tools), None
    text = render_chat(tokenizer, messages, tools, settings.chat_template, kwargs)
    # The model reasons whether or not this request wants the reasoning split off.
    mode = initial_mode(parser, text)
    param, constraint = constraint_from_fields(constraint_fields or {}) or (None, None)
    if plan.constraint is not None and constraint is None:
        constraint, param = plan.constraint, "tools"
    elif plan.constraint is not None and plan.mode != "auto":  # auto's gives way to the request's
        raise InvalidRequestError(
            "tool_choice", f"a required or named tool call cannot be combined with {param}"
        )
    if constraint is not None and mode != Mode.CONTENT:
        # The answer is constrained, the reasoning before it is not: the grammar starts after
        # the end tag's tokens.
        end_ids = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
        constraint = Constraint(constraint.kind, constraint.value, end_ids)
    return PreparedChat(
        # the template wrote the special tokens
        list(tokenizer.encode(text, add_special_tokens=False)),
        plan,
        settings.tool_call_parser,
        parser if p.separate_reasoning else None,
        mode,
        constraint,
        param,
    )
