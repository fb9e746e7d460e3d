"""Helpers shared by the incremental parsers: holding back text that may start a tag."""

from __future__ import annotations

from collections.abc import Sequence


def partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text a
    parser must hold back, because the next chunk may complete the tag."""
    longest = max((len(t) for t in tags), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-length:]
        if any(tag.startswith(suffix) for tag in tags):
            return length
    return 0


def find_first(text: str, tags: Sequence[str]) -> tuple[int, str | None]:
    """(position, tag) of the earliest tag in `text`; (-1, None) when none occurs."""
    best_at, best_tag = -1, None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best_at < 0 or at < best_at):
            best_at, best_tag = at, tag
    return best_at, best_tag


def split_trailing_space(text: str) -> tuple[str, str]:
    """(text without its trailing whitespace, that whitespace)."""
    stripped = text.rstrip()
    return stripped, text[len(stripped) :]
