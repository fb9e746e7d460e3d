"""The layer between the tokenizer and the API dialects: chat options, reasoning and tool-call
parsing, a reply's ordered blocks, and the request fields that become a structured-output
constraint."""

from minisgl.chat.output import CALL, REASONING, ChatDelta, ChatOutputParser, ReplyBlocks
from minisgl.chat.prepare import (
    ChatPrompt,
    ChatSettings,
    PreparedChat,
    prepare_chat,
    prompt_texts,
    with_reasoning_effort,
)

__all__ = [
    "CALL",
    "REASONING",
    "ChatDelta",
    "ChatOutputParser",
    "ChatPrompt",
    "ChatSettings",
    "PreparedChat",
    "ReplyBlocks",
    "prepare_chat",
    "prompt_texts",
    "with_reasoning_effort",
]
