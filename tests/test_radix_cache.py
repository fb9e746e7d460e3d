"""RadixCache: unit tests, a model-based stateful test against a reference trie, a scale test."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.kvcache.radix import NaiveCache, RadixCache, _Node


def _slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _slot_range(start: int, num_slots: int) -> torch.Tensor:
    return torch.arange(start, start + num_slots, dtype=torch.int64)


Pages = dict[tuple[int, ...], tuple[int, ...]]


def _contents(cache: RadixCache) -> Pages:
    """Every cached page-aligned prefix -> the slots of its last page (the tree, flattened).

    Keyed per page, not per token: two pages may share their first tokens but not their slots.
    """
    page_size = cache.page_size
    out: Pages = {}
    stack: list[tuple[_Node, tuple[int, ...]]] = [(c, ()) for c in cache._root.children.values()]
    while stack:
        node, prefix = stack.pop()
        slots = node.slot_indices.tolist()
        for start in range(0, len(slots), page_size):
            prefix = (*prefix, *node.key[start : start + page_size])
            out[prefix] = tuple(slots[start : start + page_size])
        stack.extend((child, prefix) for child in node.children.values())
    return out


def check_invariants(cache: RadixCache) -> None:
    """Assert the tree invariants of minisgl/kvcache/radix.py's docstring with a full walk."""
    evictable_len = protected_len = 0
    leaves: set[_Node] = set()
    for node in cache._iter_nodes():
        assert node.parent is not None and node.lock_ref >= 0
        assert 0 < len(node.key) == len(node.slot_indices)
        assert len(node.key) % cache.page_size == 0
        assert node.slot_indices.dtype == torch.int64
        assert node.parent.children[cache._page_key(node.key)] is node
        if node.parent is not cache._root:
            assert node.parent.lock_ref >= node.lock_ref
        assert node.lock_ref >= sum(child.lock_ref for child in node.children.values())
        if node.lock_ref > 0:
            protected_len += len(node.key)
        else:
            evictable_len += len(node.key)
            if not node.children:
                leaves.add(node)
    assert (evictable_len, protected_len) == (cache.evictable_size, cache.protected_size)
    assert leaves == cache._evictable_leaves
    live = {(n.last_access, n.node_id) for n in leaves}
    assert live <= {(access, node_id) for access, node_id, _ in cache._lru_heap}


# ---- unit tests ---------------------------------------------------------------------------------


def test_exact_and_partial_match_page1() -> None:
    cache = RadixCache(page_size=1)
    assert cache.insert([1, 2, 3, 4], _slot_range(10, 4)) == 0
    assert cache.match_prefix([1, 2, 3, 4]).slot_indices.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([1, 2, 3, 4, 5]).matched_len == 4
    assert cache.match_prefix([7, 1, 2]).matched_len == 0
    assert cache.match_prefix([]).matched_len == 0

    partial = cache.match_prefix([1, 2, 9])  # ends inside the node: splits it at 2
    assert partial.slot_indices.tolist() == [10, 11]
    assert len(cache._root.children[1].key) == 2
    check_invariants(cache)

    assert cache.insert([1, 2, 7, 8], _slot_range(20, 4)) == 2  # branches off the split point
    assert cache.match_prefix([1, 2, 7, 8]).slot_indices.tolist() == [10, 11, 22, 23]
    assert cache.match_prefix([1, 2, 3, 4]).slot_indices.tolist() == [10, 11, 12, 13]
    assert (cache.evictable_size, cache.protected_size) == (6, 0)
    check_invariants(cache)


def test_page_size_4_matches_whole_pages_only() -> None:
    cache = RadixCache(page_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.insert(tokens, _slot_range(0, 8)) == 0
    assert cache.match_prefix(tokens[:7]).matched_len == 4  # unaligned tail ignored
    assert cache.match_prefix([*tokens, 9, 9, 9]).matched_len == 8
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    # Diverges inside the second page: the match (and the split) stop at the page boundary.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).slot_indices.tolist() == [0, 1, 2, 3]
    assert cache.match_prefix([1, 2, 0, 0]).matched_len == 0  # diverges inside the first page
    assert cache.insert([1, 2, 3, 4, 5, 6, 0, 0], _slot_range(100, 8)) == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).slot_indices.tolist() == [
        *range(4),
        *range(104, 108),
    ]
    check_invariants(cache)

    with pytest.raises(AssertionError, match="page_size"):
        cache.insert([1, 2, 3], _slot_range(0, 3))
    with pytest.raises(AssertionError, match="slot indices"):
        cache.insert([1, 2, 3, 4], _slot_range(0, 8))


def test_insert_returns_existing_prefix_len() -> None:
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4], _slot_range(0, 4)) == 0
    assert cache.insert([1, 2, 3, 4], _slot_range(10, 4)) == 4  # nothing taken
    assert cache.insert([1, 2, 3, 4, 5, 6], _slot_range(20, 6)) == 4  # takes [24, 25]
    assert cache.insert([1, 2, 9, 9], _slot_range(30, 4)) == 2  # takes [32, 33]
    assert cache.total_size == 8
    assert sorted(cache.reset().tolist()) == [0, 1, 2, 3, 24, 25, 32, 33]


def test_insert_copies_slot_indices() -> None:
    cache = RadixCache(page_size=1)
    buffer = _slot_range(0, 3)
    cache.insert([1, 2, 3], buffer)
    buffer.fill_(-1)  # the caller reuses its buffer; the cache must not see that
    assert cache.match_prefix([1, 2, 3]).slot_indices.tolist() == [0, 1, 2]


def test_lock_protects_from_eviction() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], _slot_range(0, 4))
    cache.insert([5, 6], _slot_range(4, 2))
    handle = cache.match_prefix([1, 2]).handle  # splits [1,2,3,4]: only [1,2] is protected
    cache.lock(handle)
    cache.lock(handle)
    assert (cache.evictable_size, cache.protected_size) == (4, 2)

    assert sorted(cache.evict(100).tolist()) == [2, 3, 4, 5]
    assert cache.match_prefix([1, 2, 3, 4]).slot_indices.tolist() == [0, 1]
    assert (cache.evictable_size, cache.protected_size) == (0, 2)

    cache.unlock(handle)
    assert cache.evict(100).numel() == 0  # still locked once
    cache.unlock(handle)
    assert (cache.evictable_size, cache.protected_size) == (2, 0)
    with pytest.raises(AssertionError, match="unlock"):
        cache.unlock(handle)
    assert cache.evict(1).tolist() == [0, 1]
    with pytest.raises(AssertionError, match="evicted"):
        cache.lock(handle)  # stale handle
    check_invariants(cache)


def test_lock_survives_a_later_split() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], _slot_range(0, 4))
    handle = cache.match_prefix([1, 2, 3, 4]).handle
    cache.lock(handle)
    cache.match_prefix([1, 2, 9])  # splits the locked node above the handle
    assert (cache.evictable_size, cache.protected_size) == (0, 4)
    check_invariants(cache)
    cache.unlock(handle)
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    check_invariants(cache)


def test_a_miss_handle_is_the_root_and_a_no_op() -> None:
    cache = RadixCache(page_size=1)
    miss = cache.match_prefix([1, 2])
    assert miss.handle is cache._root
    cache.lock(miss.handle)
    cache.unlock(miss.handle)
    cache.unlock(miss.handle)
    assert cache.total_size == 0


def test_evict_lru_order() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 1], _slots(10, 11))
    cache.insert([2, 2], _slots(20, 21))
    cache.insert([3, 3], _slots(30, 31))
    cache.match_prefix([1])  # splits [1,1]; touches its upper half, not the leaf [1]
    cache.match_prefix([2, 2])  # touches all of [2,2]
    assert cache.evict(1).tolist() == [11]  # leaf under [1]: last touched at insert time
    assert cache.evict(2).tolist() == [30, 31]  # [1] is a leaf now, but touched after [3,3]
    assert cache.evict(1).tolist() == [10]
    assert cache.evict(1).tolist() == [20, 21]
    assert cache.evict(1).numel() == 0
    assert cache.total_size == 0
    check_invariants(cache)


def test_evict_parent_becomes_candidate() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], _slots(0, 1))
    cache.insert([1, 2, 3], _slots(0, 1, 2))
    cache.insert([1, 2, 4], _slots(0, 1, 3))
    cache.insert([9], _slots(9))
    cache.match_prefix([9])  # newest: evicted last
    assert cache.evict(3).tolist() == [2, 3, 0, 1]
    assert cache.evict(1).tolist() == [9]


def test_reset() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], _slot_range(0, 4))
    cache.insert([1, 2, 5, 6], _slot_range(10, 4))
    handle = cache.match_prefix([1, 2]).handle
    cache.lock(handle)
    with pytest.raises(AssertionError, match="locked"):
        cache.reset()
    cache.unlock(handle)
    assert sorted(cache.reset().tolist()) == [0, 1, 2, 3, 12, 13]
    assert cache.total_size == 0
    assert cache.match_prefix([1, 2, 3, 4]).matched_len == 0
    assert cache.reset().numel() == 0
    check_invariants(cache)


def test_naive_cache_keeps_nothing() -> None:
    naive = NaiveCache(1)
    assert naive.insert([1, 2], _slots(0, 1)) == 2
    assert naive.match_prefix([1, 2]).matched_len == 0 and naive.total_size == 0


# ---- model-based test ---------------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 3), max_size=12)


@dataclass
class _FakeRequest:
    tokens: list[int]
    handle: object
    matched_len: int
    slots: list[int]  # [:matched_len] are the cache's (locked), the rest are the request's own


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives a RadixCache like a scheduler would and mirrors it in a flat reference trie.

    Slot ownership is tracked by hand: each slot is in the fake free list, in the cache (`ref`),
    or owned by a fake running request, and the checks after every step insist on exactly one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 1
        self.cache = RadixCache(self.page_size)
        self.ref: Pages = {}  # cached page-aligned prefix -> slots of its last page
        self.num_slots_made = 0
        self.free_slots: list[int] = []
        self.running: list[_FakeRequest] = []

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def choose_page_size(self, page_size: int) -> None:
        self.page_size = page_size
        self.cache = RadixCache(page_size)

    # -- helpers

    def _alloc(self, num_slots: int) -> list[int]:
        # Reuse freed slots first, so a slot the cache wrongly still holds gets double-owned.
        taken = self.free_slots[:num_slots]
        del self.free_slots[:num_slots]
        fresh = list(range(self.num_slots_made, self.num_slots_made + num_slots - len(taken)))
        self.num_slots_made += len(fresh)
        return taken + fresh

    def _aligned_len(self, tokens: list[int]) -> int:
        return len(tokens) - len(tokens) % self.page_size

    def _ref_match(self, tokens: list[int]) -> list[int]:
        slots: list[int] = []
        for end in range(self.page_size, self._aligned_len(tokens) + 1, self.page_size):
            page_slots = self.ref.get(tuple(tokens[:end]))
            if page_slots is None:
                break
            slots += page_slots
        return slots

    def _held_slots(self) -> list[int]:
        return [slot for page_slots in self.ref.values() for slot in page_slots]

    def _match_checked(self, tokens: list[int]) -> tuple[object, list[int]]:
        expected = self._ref_match(tokens)
        result = self.cache.match_prefix(tokens)
        assert result.slot_indices.dtype == torch.int64
        assert result.slot_indices.tolist() == expected
        return result.handle, expected

    def _insert_checked(self, tokens: list[int], slots: list[int], matched_len: int) -> None:
        """Offer the aligned part like a finished request; free what the cache did not take."""
        aligned_len = self._aligned_len(tokens)
        expected_prefix_len = len(self._ref_match(tokens[:aligned_len]))
        assert expected_prefix_len >= matched_len
        prefix_len = self.cache.insert(tokens[:aligned_len], torch.tensor(slots[:aligned_len]))
        assert prefix_len == expected_prefix_len
        for start in range(prefix_len, aligned_len, self.page_size):
            end = start + self.page_size
            self.ref[tuple(tokens[:end])] = tuple(slots[start:end])
        self.free_slots += slots[matched_len:prefix_len] + slots[aligned_len:]

    # -- rules

    @rule(tokens=token_lists)
    def match(self, tokens: list[int]) -> None:
        self._match_checked(tokens)

    @rule(tokens=token_lists)
    def insert(self, tokens: list[int]) -> None:
        _, cached = self._match_checked(tokens)
        self._insert_checked(tokens, cached + self._alloc(len(tokens) - len(cached)), len(cached))

    @rule(tokens=token_lists)
    def start_request(self, tokens: list[int]) -> None:
        handle, cached = self._match_checked(tokens)
        self.cache.lock(handle)
        own = self._alloc(len(tokens) - len(cached))
        self.running.append(_FakeRequest(tokens, handle, len(cached), cached + own))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000))
    def finish_request(self, pick: int) -> None:
        req = self.running.pop(pick % len(self.running))
        self._insert_checked(req.tokens, req.slots, req.matched_len)
        self.cache.unlock(req.handle)

    @rule(num_tokens=st.integers(0, 16))
    def evict(self, num_tokens: int) -> None:
        evictable_before = self.cache.evictable_size
        released = self.cache.evict(num_tokens).tolist()
        assert len(released) >= min(num_tokens, evictable_before)
        assert len(set(released)) == len(released)
        released_set = set(released)
        assert released_set <= set(self._held_slots()), "released a slot the cache did not hold"
        kept = {key: slots for key, slots in self.ref.items() if released_set.isdisjoint(slots)}
        num_pages_released = len(self.ref) - len(kept)
        assert len(released) == num_pages_released * self.page_size, "released part of a page"
        self.ref = kept
        self.free_slots += released
        for req in self.running:  # locked prefixes survive, whole
            assert self.cache.match_prefix(req.tokens).matched_len >= req.matched_len

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        released = self.cache.reset().tolist()
        assert sorted(released) == sorted(self._held_slots())
        self.ref.clear()
        self.free_slots += released

    # -- checks after every step

    @invariant()
    def cache_matches_reference(self) -> None:
        check_invariants(self.cache)  # includes lock_ref >= 0 and the size bookkeeping
        assert _contents(self.cache) == self.ref
        assert self.cache.total_size == len(self.ref) * self.page_size
        locked_pages = {
            tuple(req.tokens[:end])
            for req in self.running
            for end in range(self.page_size, req.matched_len + 1, self.page_size)
        }
        assert self.cache.protected_size == len(locked_pages) * self.page_size

    @invariant()
    def every_slot_in_exactly_one_place(self) -> None:
        owners = [*self.free_slots, *self._held_slots()]
        for req in self.running:
            owners += req.slots[req.matched_len :]
        assert sorted(owners) == list(range(self.num_slots_made))


RadixCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None
)
TestRadixCacheMachine = RadixCacheMachine.TestCase


# ---- scale --------------------------------------------------------------------------------------


def test_scale_insert_then_evict_everything() -> None:
    rng = random.Random(0)
    cache = RadixCache(page_size=1)
    # Shared system-prompt-like stems make a bushy tree with many splits.
    stems = [[rng.randrange(100) for _ in range(rng.randrange(0, 32))] for _ in range(50)]
    num_slots_held = 0
    start = time.perf_counter()
    for _ in range(3000):
        tokens = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.randrange(1, 48))]
        cached = cache.match_prefix(tokens).slot_indices
        new_slots = _slot_range(num_slots_held, len(tokens) - len(cached))
        assert cache.insert(tokens, torch.cat([cached, new_slots])) == len(cached)
        num_slots_held += len(new_slots)  # the cache took all of them: slot numbers stay dense
    insert_s = time.perf_counter() - start
    assert cache.total_size == num_slots_held

    start = time.perf_counter()
    released = []
    while cache.total_size > 0:
        released.append(cache.evict(64))
    evict_s = time.perf_counter() - start
    print(
        f"radix scale: 3000 inserts {insert_s:.3f}s, evict {num_slots_held} tokens {evict_s:.3f}s"
    )
    assert sorted(torch.cat(released).tolist()) == list(range(num_slots_held))
    assert insert_s + evict_s < 10.0
