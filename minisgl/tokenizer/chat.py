"""Load a tokenizer and turn chat messages into prompt token ids."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local checkpoint folder (never downloads)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def message_text(content: Any, index: int) -> str:
    """A message's content as one string: a string, or a list of {"type": "text"} parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping) or part.get("type", "text") != "text":
                raise ValueError(f"messages: message {index} has a content part that is not text")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages: message {index} has a text part without 'text'")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"messages: message {index} content must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Check the shape of chat messages and return plain {"role", "content"} dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role', 'content'} objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages: message {index} must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages: message {index} has unknown role {role!r}")
        normalized.append({"role": role, "content": message_text(message.get("content"), index)})
    return normalized


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Render messages with the tokenizer's chat template, ready for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the tokenizer has no chat template; use /v1/completions")
    try:
        encoded = tokenizer.apply_chat_template(
            normalize_messages(messages), add_generation_prompt=True, tokenize=True
        )
    except TemplateError as exc:  # e.g. raise_exception("roles must alternate ...")
        raise ValueError(f"messages: the model's chat template rejected them: {exc}") from None
    # transformers 5 returns a dict-like BatchEncoding; older versions return the id list itself.
    ids: Any = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(t) for t in ids]


def render_chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """The chat prompt as text (for echo and debugging)."""
    text = tokenizer.apply_chat_template(
        normalize_messages(messages), add_generation_prompt=True, tokenize=False
    )
    return str(text)
