"""Chat templates: turn chat messages (and tools) into prompt token ids.

Messages keep every field a chat template reads: `name`, `tool_calls` on assistant messages,
`tool_call_id` on tool messages and `reasoning_content`. Tool-call arguments arrive as JSON
text (OpenAI's shape) and are handed to the template as objects, the shape transformers
documents for chat templates (Llama 3's template applies `tojson` to them; Qwen's accepts both).
"""

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

import minisgl.chat.jsontext as jsontext
from minisgl.limits import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content")


def load_chat_template(path: str | Path) -> str:
    """--chat-template: a Jinja file that replaces the checkpoint's template."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"chat_template: cannot read {path}: {exc.strerror or exc}") from None


def text_content(
    content: Any, where: str, param: str, text_types: Collection[str] = ("text",)
) -> str:
    """Text, or a list of text parts (of `text_types`, "text" where a part names none; a refusal
    part's text is its "refusal"), as one string: a chat message's content, the Responses and
    Anthropic APIs'. Anything else is a 400 naming `param`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(param, f"{where}: content must be text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind in text_types else None
        if not isinstance(text, str):
            message = f"must be a text part, not {kind!r}: the model reads text"
            raise InvalidRequestError(param, f"{where}.content[{j}]: {message}")
        texts.append(text)
    return "".join(texts)


def _tool_calls(value: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, each {"id", "type", "function": {name, arguments}},
    arguments parsed to an object when they are JSON object text."""
    where = f"messages: message {index} tool_calls"
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: each call needs function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            parsed = jsontext.loads_object(arguments)
            arguments = arguments if parsed is None else parsed
        elif not isinstance(arguments, Mapping):
            raise ValueError(f"{where}: function.arguments must be JSON text or an object")
        named = {"name": function["name"], "arguments": arguments}
        entry: dict[str, Any] = {"type": "function", "function": named}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of chat messages and return plain dicts: role, content (a string) and
    the other fields templates read, where given."""
    if not messages:  # (a list or None: the request's schema says so)
        raise ValueError("messages: must be a non-empty list of {'role', 'content'} objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages: message {index} must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages: message {index} has unknown role {role!r}")
        content = message.get("content")
        # Only an assistant turn may come without content (a reply that only called tools).
        if content is None and role != "assistant":
            raise ValueError(f"messages: message {index} ({role}) needs a content")
        entry: dict[str, Any] = {
            "role": role,
            "content": text_content(content or "", f"messages[{index}]", "messages"),
        }
        for name in _TEXT_FIELDS:
            if (value := message.get(name)) is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"messages: message {index} {name} must be a string")
            entry[name] = value
        if (calls := message.get("tool_calls")) is not None:
            if role != "assistant":
                raise ValueError(
                    f"messages: message {index}: only assistant messages have tool_calls"
                )
            entry["tool_calls"] = _tool_calls(calls, index)
        normalized.append(entry)
    return normalized


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    tools: list[Any] | None = None,  # the JSON tool specs, as transformers takes them
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for the assistant's reply. `template_kwargs` (e.g. enable_thinking) are
    variables for the template; `chat_template` replaces the tokenizer's own."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the tokenizer has no chat template; use /v1/completions")
    conversation = normalize_messages(messages)  # its errors name the message at fault
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:  # e.g. raise_exception("roles must alternate ...")
        raise ValueError(f"messages: the model's chat template rejected them: {exc}") from None
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
        # a template reading a field these messages lack, or rejecting their shape
        raise ValueError(f"messages: the chat template failed on them: {exc}") from None
    return str(text)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render messages with the chat template, ready for the assistant's reply, as ids."""
    text = render_chat(tokenizer, messages, tools, chat_template, template_kwargs)
    # the template wrote the special tokens
    return list(tokenizer.encode(text, add_special_tokens=False))
