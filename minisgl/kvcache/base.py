"""The prefix-cache contract shared by the radix tree and the no-reuse cache.

Units: everything is counted in tokens; a "slot" is one token's row in the KV pool
(slot = page * page_size + offset). The cache stores slot indices, never KV data, and never talks
to the page allocator: slots it gives back (evict, reset, insert's refusals) are the caller's to
free. Keys and slot lists are page-aligned: their length is a multiple of `page_size`.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class MatchResult:
    handle: Any  # opaque: give it back to lock/unlock
    slot_indices: Tensor  # int64 [matched_len], slots of the matched prefix in order

    @property
    def matched_len(self) -> int:
        return int(self.slot_indices.numel())


class PrefixCache(ABC):
    """Maps token-id prefixes to the KV slots that hold them.

    Ownership: a slot is in exactly one place: the page allocator's free list, this cache, or a
    running request. `lock` protects a matched prefix from eviction while a request uses it;
    every `lock` is paired with one `unlock` of the same handle. An implementation keeps
    `evictable_size` and `protected_size` (tokens, read-only to callers) up to date.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.evictable_size = 0  # tokens held in unlocked entries (can be evicted now)
        self.protected_size = 0  # tokens held in locked entries

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids` (page-aligned). Updates LRU access time."""

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Protect the matched prefix (and its ancestors) from eviction."""

    @abstractmethod
    def unlock(self, handle: Any) -> None:
        """Undo one `lock`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slot_indices: Tensor) -> int:
        """Offer a computed sequence; len(token_ids) == len(slot_indices), page-aligned.

        Returns `n`: the cache did not take `slot_indices[:n]` (it already held that prefix, or
        it keeps nothing); it owns `slot_indices[n:]` from now on. The caller frees the slots in
        `[its own matched_len, n)`; slots below its matched_len were the cache's to begin with.
        The returned handle semantics: nothing new is locked by insert.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> Tensor:
        """Drop unlocked entries, least recently used leaves first, until at least `num_tokens`
        slots are released or nothing evictable remains. Returns the released slots (int64)."""

    @abstractmethod
    def reset(self) -> Tensor:
        """Drop everything (no entry may be locked). Returns all slots the cache held."""

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size
