"""KV page ownership for the scheduler: free pages, the prefix cache, and what requests hold;
and the table rows (a request's slot in the engine's page and token tables).

Every page is in exactly one place (`check_page_accounting`), and table writes are queued for the
next forward (`DeviceTables`), so the scheduler never waits for the device
(docs/architecture.md#memory-layout)."""

from collections.abc import Iterable

import numpy as np
import torch

from minisgl.core import Req
from minisgl.engine.tables import DeviceTables
from minisgl.kvcache.radix import NaiveCache, RadixCache


class FreeList:
    """Which of the ids 0..size-1 (pages, table rows) are free. A stack, lowest id on top at
    first: the most recently freed are reused first (pages warm in cache, rows in a stable
    order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[int] = list(range(size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, num: int) -> list[int] | None:
        if num > len(self._free):
            return None
        ids = self._free[len(self._free) - num :]
        del self._free[len(self._free) - num :]
        return ids

    def free(self, ids: Iterable[int]) -> None:
        self._free.extend(ids)


class CacheManager:
    def __init__(
        self, num_pages: int, page_size: int, cache_type: str, tables: DeviceTables
    ) -> None:
        self.page_size = page_size
        self.allocator = FreeList(num_pages)  # pages
        # --cache-type: radix shares prefixes, naive keeps nothing (ServerArgs checked the name)
        self.prefix_cache = (NaiveCache if cache_type == "naive" else RadixCache)(page_size)
        self.tables = tables
        self.rows = FreeList(tables.num_rows)
        self._page_offsets = np.arange(page_size, dtype=np.int64)

    # ---- accounting ------------------------------------------------------------------------

    @property
    def num_total_pages(self) -> int:
        return self.allocator.size

    @property
    def num_available_pages(self) -> int:
        """Pages obtainable now: free ones plus what the prefix cache could evict."""
        return self.allocator.num_free + self.prefix_cache.evictable_size // self.page_size

    def check_page_accounting(self, live: Iterable[Req]) -> None:
        owned = sum(len(r.page_ids) - r.cache_matched_len // self.page_size for r in live)
        cached = self.prefix_cache.total_size // self.page_size
        total = self.allocator.num_free + cached + owned
        assert total == self.num_total_pages, (
            f"KV page leak: free {self.allocator.num_free} + cached {cached} + owned {owned} "
            f"!= {self.num_total_pages}"
        )

    # ---- request life cycle -----------------------------------------------------------------

    def admit(self, req: Req) -> None:
        """Give `req` a table row (the caller checked that one is free) and its cached prefix."""
        rows = self.rows.alloc(1)
        assert rows is not None, "admitted without a free table row"
        row = req.table_row = rows[0]
        all_ids = req.all_ids
        # Keep at least one token to compute: its logits give the next token (or the last
        # token's state, an embedding). A request that wants its prompt's logprobs, or an
        # embedding pooled from every token, computes it all: a cache hit has neither.
        reusable_len = len(all_ids) - 1
        pooling = req.sampling_params.pooling
        if req.scores_prompt or (pooling is not None and pooling.reads_prefix):
            reusable_len = 0
            req.prompt_logprobs.clear()  # retracted mid-prompt: scored again from the start
            req.pooled = 0
        match = self.prefix_cache.match_prefix(all_ids[:reusable_len])
        self.prefix_cache.lock(match.handle)
        req.cache_handle = match.handle
        req.cache_matched_len = req.cached_len = match.matched_len
        req.device_len = len(all_ids)
        req.page_ids = self._slots_to_pages(match.slot_indices)
        self.tables.write_tokens(row, 0, all_ids)
        self.tables.write_slots([row], [0], match.slot_indices[None, :])

    def reserve(self, reqs: list[Req], end_lens: list[int]) -> bool:
        """Make positions [0, end_lens[i]) of each reqs[i] have KV slots, evicting cached entries
        if needed: all of them (one allocation and one table write for the lot), or none."""
        ps = self.page_size
        short = [
            (req, num)
            for req, end in zip(reqs, end_lens, strict=True)
            if (num := -(-end // ps) - len(req.page_ids)) > 0
        ]
        if not short:
            return True
        pages = self._alloc_pages(sum(num for _, num in short))
        if pages is None:
            return False
        rows: list[int] = []
        starts: list[int] = []
        taken = 0
        for req, num in short:
            have = len(req.page_ids)
            rows += [req.table_row] * num
            starts += range(have * ps, (have + num) * ps, ps)
            req.page_ids += pages[taken : taken + num]
            taken += num
        self.tables.write_slots(rows, starts, self._pages_to_slots(pages).view(-1, ps))
        return True

    def trim(self, req: Req) -> None:
        """Free the pages past `req.device_len` (a verify step's rejected drafts had them)."""
        keep = -(-req.device_len // self.page_size)
        self.allocator.free(req.page_ids[keep:])
        del req.page_ids[keep:]

    def _alloc_pages(self, num: int) -> list[int] | None:
        short = num - self.allocator.num_free
        if short > 0:
            if short * self.page_size > self.prefix_cache.evictable_size:
                return None
            evicted = self.prefix_cache.evict(short * self.page_size)
            self.allocator.free(self._slots_to_pages(evicted))
        return self.allocator.alloc(num)

    def cache_prefix(self, req: Req) -> None:
        """Share `req`'s computed prompt prefix now, not only when it finishes (SGLang's "cache
        unfinished request"), so requests that arrive meanwhile with the same prefix reuse it.
        Called right after a prefill chunk is scheduled: the batch that writes the chunk's KV runs
        before any later one. The tree takes the new full pages under `req`'s lock; ownership moves
        with `cache_matched_len`, so nothing is copied or freed."""
        ps = self.page_size
        aligned = min(req.cached_len, req.prompt_len + len(req.output_ids)) // ps * ps
        if aligned <= req.cache_matched_len:
            return
        ids = req.all_ids[:aligned]
        # Only extend what this request matched: if another request cached more of this prefix
        # meanwhile, its pages and ours would duplicate; that is sorted out at release instead.
        if self.prefix_cache.match_prefix(ids).matched_len != req.cache_matched_len:
            return
        slots = self._pages_to_slots(req.page_ids[: aligned // ps])
        not_taken = self.prefix_cache.insert(ids, slots)
        if not_taken != req.cache_matched_len:  # a cache that keeps nothing (naive)
            return
        match = self.prefix_cache.match_prefix(ids)
        self.prefix_cache.lock(match.handle)
        self.prefix_cache.unlock(req.cache_handle)
        req.cache_handle, req.cache_matched_len = match.handle, aligned

    def release(self, req: Req) -> None:
        """Return everything `req` holds: computed full pages go to the prefix cache (so a later
        request, or this one after retraction, can reuse them); the rest to the free list."""
        ps = self.page_size
        computed = min(req.cached_len, len(req.all_ids))
        num_full_pages = min(computed // ps, len(req.page_ids))
        slots = self._pages_to_slots(req.page_ids[:num_full_pages])
        not_taken = self.prefix_cache.insert(req.all_ids[: num_full_pages * ps], slots)
        matched_pages = req.cache_matched_len // ps
        # Pages in [matched, not_taken) duplicate what the cache already held: free them.
        self.allocator.free(req.page_ids[matched_pages : not_taken // ps])
        self.allocator.free(req.page_ids[num_full_pages:])
        self._give_back_row(req)

    def discard(self, req: Req) -> None:
        """Return everything `req` holds without caching any of it: after a failed step its KV
        may be incomplete. The pages it shared into the prefix cache stay there; the caller
        flushes the cache (nothing may reuse them either)."""
        self.allocator.free(req.page_ids[req.cache_matched_len // self.page_size :])
        self._give_back_row(req)

    def _give_back_row(self, req: Req) -> None:
        """The last of a release: `req`'s lock on its cached prefix, and its row."""
        self.prefix_cache.unlock(req.cache_handle)
        self.rows.free([req.table_row])
        req.page_ids, req.cache_handle, req.cache_matched_len = [], None, 0
        req.table_row, req.cached_len = -1, 0

    def flush(self) -> None:
        """Empty the prefix cache (only valid when no request is live)."""
        self.allocator.free(self._slots_to_pages(self.prefix_cache.reset()))

    def _pages_to_slots(self, pages: list[int]) -> torch.Tensor:
        """The slots of `pages`, in order (int64): the same values the page table holds, computed
        on the host so the scheduler never reads the device table."""
        slots = np.asarray(pages, np.int64)[:, None] * self.page_size + self._page_offsets
        return torch.from_numpy(slots.ravel())  # numpy: a fraction of torch's cost per call

    def _slots_to_pages(self, slots: torch.Tensor) -> list[int]:
        # The cache hands back whole pages, each as page_size consecutive slots in order.
        return slots[:: self.page_size].div(self.page_size, rounding_mode="floor").tolist()
