"""Prefix caches: which token prefixes already have KV in the pool. The radix tree shares a common
token prefix's KV slots between requests (the tree's invariants are listed above `_Node`;
tests/test_radix_cache.py asserts them after every step); `NaiveCache` keeps nothing.

Units: everything is counted in tokens; a "slot" is one token's row in the KV pool
(slot = page * page_size + offset). The cache stores slot indices, never KV data, and never talks
to the page allocator: slots it gives back (evict, reset, insert's refusals) are the caller's to
free. Keys and slot lists are page-aligned: their length is a multiple of `page_size`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Rebuild the LRU heap once it holds more than this many entries per live candidate (plus a
# floor), so lazy invalidation keeps memory and pop cost O(candidates) amortized.
_HEAP_MAX_ENTRIES_PER_LEAF = 2
_HEAP_MIN_REBUILD_LEN = 64


@dataclass(frozen=True)
class MatchResult:
    handle: Any  # opaque: give it back to lock/unlock
    slot_indices: Tensor  # int64 [matched_len], slots of the matched prefix in order

    @property
    def matched_len(self) -> int:
        return int(self.slot_indices.numel())


def _empty_slots() -> Tensor:
    return torch.empty(0, dtype=torch.int64)


def _common_len(key: list[int], tokens: list[int], start: int, page_size: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`, rounded down to pages."""
    limit = min(len(key), len(tokens) - start)
    n = 0
    while n < limit and key[n] == tokens[start + n]:
        n += 1
    return n - n % page_size


# Tree invariants:
# - Every non-root node has a non-empty key (token ids) whose length is a multiple of
#   `page_size`, and an int64 slot tensor of the same length. A node stands for the prefix made of
#   the keys on its path from the root; slot `i` of a node holds the KV of its key token `i`.
# - A node sits in its parent's `children` under its first page (`_page_key`), so siblings never
#   share a first page; nodes are split only at page boundaries, so pages are never shared.
# - `lock_ref` counts locks taken on the node or any descendant (a lock walks the whole path up),
#   so parent.lock_ref >= sum of its children's. Tokens of nodes with lock_ref > 0 are protected,
#   the rest evictable: evictable_size + protected_size == tokens held.
# - `_evictable_leaves` is exactly the set of non-root leaves with lock_ref == 0. `_lru_heap`
#   holds a `(last_access, node_id, node)` entry for each of them, plus stale entries (node no
#   longer a candidate, or touched since) that `evict` skips; it is rebuilt when they pile up.
@dataclass(eq=False, slots=True)  # eq=False: nodes compare and hash by identity
class _Node:
    key: list[int]
    slot_indices: Tensor
    parent: _Node | None  # None for the root and for evicted (detached) nodes
    node_id: int  # unique heap tie-breaker (nodes themselves are not orderable)
    last_access: int  # logical clock, not wall time: deterministic LRU
    children: dict[Hashable, _Node] = field(default_factory=dict)
    lock_ref: int = 0


class RadixCache:
    """Maps token-id prefixes to the KV slots that hold them, over a radix tree of token ids
    (its invariants are listed above `_Node`).

    Ownership: a slot is in exactly one place: the page allocator's free list, this cache, or a
    running request. `lock` protects a matched prefix from eviction while a request uses it;
    every `lock` is paired with one `unlock` of the same handle. `evictable_size` (tokens in
    unlocked entries) and `protected_size` (in locked ones) are read-only to callers.

    Handles are tree nodes. A handle stays valid across later splits: the split node keeps its
    identity as the lower half and the new upper half copies its lock_ref.
    """

    def __init__(self, page_size: int) -> None:
        assert page_size >= 1, f"page_size must be >= 1, got {page_size}"
        self.page_size = page_size
        self._clear()

    def _clear(self) -> None:
        self._node_ids = itertools.count()
        self._clock = 0  # bumped once per match/insert; all nodes on that path get the new time
        self._root = _Node([], _empty_slots(), None, next(self._node_ids), 0)
        self.evictable_size = self.protected_size = 0
        self._evictable_leaves: set[_Node] = set()
        self._lru_heap: list[tuple[int, int, _Node]] = []

    # ---- public API -------------------------------------------------------------------------

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids` (page-aligned). Updates LRU access time."""
        tokens = list(token_ids)
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]  # unaligned tail never hits
        node, chunks = self._walk(tokens)
        return MatchResult(node, torch.cat(chunks) if chunks else _empty_slots())

    def lock(self, handle: Any) -> None:
        """Protect the matched prefix (and its ancestors) from eviction."""
        for node in self._path_to_root(handle):
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1

    def unlock(self, handle: Any) -> None:
        """Undo one `lock`."""
        # Checked up front so a bad unlock leaves the tree untouched; ancestors' lock_ref >= ours.
        assert handle is self._root or handle.lock_ref > 0, "unlock without a lock"
        for node in self._path_to_root(handle):
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                self._refresh_candidate(node)

    def insert(self, token_ids: Sequence[int], slot_indices: Tensor) -> int:
        """Offer a computed sequence; len(token_ids) == len(slot_indices), page-aligned.

        Returns `n`: the cache did not take `slot_indices[:n]` (it already held that prefix, or
        it keeps nothing); it owns `slot_indices[n:]` from now on. The caller frees the slots in
        `[its own matched_len, n)`; slots below its matched_len were the cache's to begin with.
        Nothing new is locked by insert.
        """
        tokens = list(token_ids)
        assert len(tokens) == len(slot_indices), (
            f"insert: {len(tokens)} token ids but {len(slot_indices)} slot indices"
        )
        assert len(tokens) % self.page_size == 0, (
            f"insert: length {len(tokens)} is not a multiple of page_size {self.page_size}"
        )
        node, chunks = self._walk(tokens)
        prefix_len = sum(len(chunk) for chunk in chunks)
        if prefix_len < len(tokens):
            # Clone: callers often pass a view of a reusable buffer (e.g. a page-table row).
            new_slots = slot_indices[prefix_len:].to(torch.int64).clone()
            leaf = _Node(tokens[prefix_len:], new_slots, node, next(self._node_ids), self._clock)
            node.children[self._page_key(leaf.key)] = leaf
            self.evictable_size += len(leaf.key)
            self._refresh_candidate(leaf)
            self._refresh_candidate(node)  # it has a child now, so it is no longer a candidate
        return prefix_len

    def evict(self, num_tokens: int) -> Tensor:
        """Drop unlocked entries, least recently used leaves first, until at least `num_tokens`
        slots are released or nothing evictable remains. Returns the released slots (int64)."""
        released: list[Tensor] = []
        released_len = 0
        while released_len < num_tokens and self._evictable_leaves:
            last_access, _, node = heapq.heappop(self._lru_heap)
            if node not in self._evictable_leaves or node.last_access != last_access:
                continue  # stale entry: locked, gained a child, or touched since it was pushed
            parent = node.parent
            assert parent is not None
            del parent.children[self._page_key(node.key)]
            node.parent = None  # detached: a leftover handle to it now fails loudly in lock
            self._evictable_leaves.remove(node)
            self.evictable_size -= len(node.key)
            released.append(node.slot_indices)
            released_len += len(node.key)
            self._refresh_candidate(parent)  # may have just become an unlocked leaf
        return torch.cat(released) if released else _empty_slots()

    def reset(self) -> Tensor:
        """Drop everything (no entry may be locked). Returns all slots the cache held."""
        assert self.protected_size == 0, "reset while a prefix is locked"
        slots = [node.slot_indices for node in self._iter_nodes()]
        self._clear()
        return torch.cat(slots) if slots else _empty_slots()

    # ---- tree mechanics ---------------------------------------------------------------------

    def _walk(self, tokens: list[int]) -> tuple[_Node, list[Tensor]]:
        """Descend along page-aligned `tokens`, splitting the last node if the match ends inside
        it, and touch every node on the way. Returns the deepest matched node (the root if
        nothing matched) and the matched slot tensors in path order."""
        self._clock += 1
        node, pos = self._root, 0
        chunks: list[Tensor] = []
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            # >= page_size, since the first page matched (it is the child's dict key).
            common_len = _common_len(child.key, tokens, pos, self.page_size)
            if common_len < len(child.key):
                child = self._split(child, common_len)
            self._touch(child)
            chunks.append(child.slot_indices)
            node, pos = child, pos + common_len
        return node, chunks

    def _split(self, node: _Node, split_len: int) -> _Node:
        """Cut `node` at page-aligned `split_len` and return the new upper half. `node` stays as
        the lower half so handles and locks taken on it keep covering the same prefix."""
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        assert split_len % self.page_size == 0
        upper = _Node(
            node.key[:split_len],
            node.slot_indices[:split_len],
            parent,
            next(self._node_ids),
            node.last_access,
        )
        upper.lock_ref = node.lock_ref  # same locks cover both halves: sizes stay unchanged
        parent.children[self._page_key(upper.key)] = upper
        node.key = node.key[split_len:]
        node.slot_indices = node.slot_indices[split_len:]
        node.parent = upper
        upper.children[self._page_key(node.key)] = node
        return upper

    def _page_key(self, tokens: list[int], start: int = 0) -> Hashable:
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    def _touch(self, node: _Node) -> None:
        node.last_access = self._clock
        if node in self._evictable_leaves:
            self._push(node)  # its old heap entry is stale now

    def _refresh_candidate(self, node: _Node) -> None:
        """Re-derive whether `node` may be evicted after its children or lock_ref changed."""
        if node is not self._root and not node.children and node.lock_ref == 0:
            if node not in self._evictable_leaves:
                self._evictable_leaves.add(node)
                self._push(node)
        else:
            self._evictable_leaves.discard(node)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._lru_heap, (node.last_access, node.node_id, node))
        max_len = _HEAP_MAX_ENTRIES_PER_LEAF * len(self._evictable_leaves) + _HEAP_MIN_REBUILD_LEN
        if len(self._lru_heap) > max_len:
            self._lru_heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
            heapq.heapify(self._lru_heap)

    def _path_to_root(self, node: _Node) -> Iterator[_Node]:
        """`node` and its ancestors, root excluded (it holds no tokens and is never locked)."""
        while node is not self._root:
            assert node.parent is not None, "handle refers to an evicted node"
            yield node
            node = node.parent

    def _iter_nodes(self) -> Iterator[_Node]:
        """All non-root nodes, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class NaiveCache(RadixCache):
    """No reuse (`--cache-type naive`): a tree that takes nothing offered, so matches nothing."""

    def insert(self, token_ids: Sequence[int], slot_indices: Tensor) -> int:
        return len(token_ids)
