"""POST /v1/messages (Anthropic's Messages API, as vLLM and llama.cpp serve it): the request
body, and its translation to a chat request that the chat path runs as it is.

What translates:
- `system` (text or text blocks) -> a leading system message; each message's content blocks:
  `text` -> its text; an assistant's `tool_use` -> `tool_calls` (input as JSON text) and
  `thinking` -> `reasoning_content`; a user's `tool_result` -> a `tool` message (before the
  user's text, where Anthropic puts results).
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` auto / any /
  tool / none -> auto / required / a named function / none, `disable_parallel_tool_use` ->
  `parallel_tool_calls: false`; `stop_sequences` -> `stop`; `thinking` enabled / disabled ->
  the template's `enable_thinking` (Qwen3's switch; `budget_tokens` is not enforced).
- The sampling extras of vLLM (min_p, penalties, seed, ...) pass through.

Images, documents, server tools (web search, code execution, ...) are a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from minisgl.core import InvalidRequestError
from minisgl.server.protocol import ChatCompletionRequest, OpenAIRequest

PASS_THROUGH_FIELDS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
)
_WIRE_NAMES = {"stop": "stop_sequences"}


class MessagesRequest(OpenAIRequest):
    model: str | None = None
    messages: list[Any]
    max_tokens: int  # required, as Anthropic has it
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Pass-through extras (PASS_THROUGH_FIELDS), typed so the chat request's checks apply.
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, Any] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages request without the budget."""

    max_tokens: int = 1


class MessagesChatRequest(ChatCompletionRequest):
    """The chat request a Messages request runs as; 400s name the Messages field."""

    def wire_param(self, name: str) -> str:
        return _WIRE_NAMES.get(name, name)


def _fail(where: str, message: str, param: str = "messages") -> InvalidRequestError:
    return InvalidRequestError(param, f"{where}: {message}")


def blocks_text(content: Any, where: str, param: str = "messages") -> str:
    """Text, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "content must be text or a list of content blocks", param)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise _fail(f"{where}.content[{j}]", "must be a text block here", param)
        if not isinstance(block.get("text"), str):
            raise _fail(f"{where}.content[{j}]", "text must be a string", param)
        texts.append(block["text"])
    return "".join(texts)


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise _fail(where, "a tool_use block needs an id and a name")
    if not isinstance(arguments, Mapping):
        raise _fail(where, "a tool_use block's input must be an object")
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _fail(where, "a tool_result block needs a tool_use_id")
    content = block.get("content", "")
    return {"role": "tool", "tool_call_id": call_id, "content": blocks_text(content, where)}


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic messages -> chat messages."""
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise _fail(where, "must be an object with role user or assistant and content")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _fail(where, "content must be text or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(block, at))
            elif kind == "tool_result" and role == "user":
                out.append(_tool_result(block, at))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by Anthropic's models; nothing a local model can read
            elif kind in ("image", "document"):
                raise _fail(at, f"{kind} blocks are not supported: the model reads text")
            else:
                raise _fail(at, f"a {kind!r} block is not supported in a {role} message")
        if role == "user" and not texts and out and out[-1]["role"] == "tool":
            continue  # only tool results: they are the turn
        entry: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if reasoning:
            entry["reasoning_content"] = "".join(reasoning)
        if calls:
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise InvalidRequestError("tools", f"tools[{i}]: {kind!r} tools are not supported")
        function: dict[str, Any] = {"name": tool.get("name")}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema", {"type": "object", "properties": {}})
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        "tool_choice", "must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name'}"
    )


def _template_kwargs(body: MessagesRequest) -> dict[str, Any] | None:
    kwargs = dict(body.chat_template_kwargs or {})
    kind = (body.thinking or {}).get("type")
    if kind in ("enabled", "disabled") and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = kind == "enabled"
    return kwargs or None


def chat_request_for(body: MessagesRequest) -> MessagesChatRequest:
    system = []
    if body.system is not None:
        text = blocks_text(body.system, "system", param="system")
        system = [{"role": "system", "content": text}] if text else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system + chat_messages(body.messages),
        "max_tokens": body.max_tokens,
        "stop": body.stop_sequences,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": not (body.tool_choice or {}).get("disable_parallel_tool_use"),
        "chat_template_kwargs": _template_kwargs(body),
        "stream": body.stream,
    }
    for name in PASS_THROUGH_FIELDS:
        fields[name] = getattr(body, name)
    return MessagesChatRequest.model_validate(fields)
