"""The layer between the tokenizer and the OpenAI protocol: chat options, reasoning and tool-call
parsing, and the request fields that become a structured-output constraint."""

from minisgl.chat.output import ChatDelta, ChatOutputParser
from minisgl.chat.prepare import ChatSettings, PreparedChat, parse_template_kwargs, prepare_chat
from minisgl.chat.requests import constraint_from_fields

__all__ = [
    "ChatDelta",
    "ChatOutputParser",
    "ChatSettings",
    "PreparedChat",
    "constraint_from_fields",
    "parse_template_kwargs",
    "prepare_chat",
]
