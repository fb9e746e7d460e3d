"""Tools for a chat template that has no place for them (SmolLM2's, for one): such a template
would drop them, and show a turn that only called tools as empty. The conversation is rewritten
in the Hermes convention (as Qwen2.5's template writes it): tools described in the system
message, calls as `<tool_call>` blocks, results as user turns in `<tool_response>` blocks.
"""

import json
from typing import Any

from minisgl.chat.template import normalize_messages
from minisgl.chat.tool_parsers import HERMES_END, HERMES_START

TOOLS_PROMPT = (
    "You may call functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n"
    "</tools>\nTo call one, write " + HERMES_START + '\n{{"name": <function name>, '
    '"arguments": <arguments object>}}\n' + HERMES_END + "\nOtherwise answer as usual."
)


def _call_block(call: dict[str, Any]) -> str:
    """A normalized call's {"name", "arguments"} as a hermes block."""
    return f"{HERMES_START}\n{json.dumps(call['function'])}\n{HERMES_END}"


def with_tools_described(messages: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools in its system message and tool turns as text."""
    conversation = normalize_messages(messages)
    specs = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    system = TOOLS_PROMPT.format(tools=specs)
    if conversation[0]["role"] == "system":
        system = conversation.pop(0)["content"] + "\n\n" + system
    rewritten = [{"role": "system", "content": system}]
    for message in conversation:
        if message["role"] == "tool":
            text = f"<tool_response>\n{message['content']}\n</tool_response>"
            rewritten.append({"role": "user", "content": text})
        elif message.get("tool_calls"):
            blocks = [message["content"], *map(_call_block, message["tool_calls"])]
            rewritten.append({"role": "assistant", "content": "\n".join(blocks).strip()})
        else:
            rewritten.append(message)
    return rewritten
