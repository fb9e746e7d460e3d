"""Text <-> token ids: chat templates and incremental detokenization with stop strings."""

from minisgl.tokenizer.chat import apply_chat_template, load_tokenizer, normalize_messages
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "apply_chat_template", "load_tokenizer", "normalize_messages"]
