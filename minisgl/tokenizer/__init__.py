"""Text <-> token ids: loading a tokenizer, and incremental detokenization with stop strings
(chat templates live in minisgl.chat.template)."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minisgl.tokenizer.detokenizer import IncrementalDetokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local checkpoint folder (never downloads)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


__all__ = ["IncrementalDetokenizer", "load_tokenizer"]
