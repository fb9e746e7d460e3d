"""The layer between the tokenizer and the API dialects: chat options, reasoning and tool-call
parsing, a reply's ordered blocks, and the request fields that become a structured-output
constraint."""

from minisgl.chat.output import (
    CALL,
    REASONING,
    TEXT,
    BlockSink,
    ChatDelta,
    ChatOutputParser,
    ReplyBlocks,
)
from minisgl.chat.prepare import (
    ChatPrompt,
    ChatSettings,
    PreparedChat,
    parse_template_kwargs,
    prepare_chat,
    prompt_texts,
    with_reasoning_effort,
)
from minisgl.chat.requests import constraint_from_fields

__all__ = [
    "CALL",
    "REASONING",
    "TEXT",
    "BlockSink",
    "ChatDelta",
    "ChatOutputParser",
    "ChatPrompt",
    "ChatSettings",
    "PreparedChat",
    "ReplyBlocks",
    "constraint_from_fields",
    "parse_template_kwargs",
    "prepare_chat",
    "prompt_texts",
    "with_reasoning_effort",
]
