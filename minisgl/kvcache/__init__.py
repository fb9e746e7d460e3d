"""Prefix caches: which token prefixes already have KV in the pool (contract: base.py)."""

from minisgl.kvcache.base import MatchResult, PrefixCache
from minisgl.kvcache.radix import NaiveCache, RadixCache

__all__ = ["MatchResult", "NaiveCache", "PrefixCache", "RadixCache", "create_prefix_cache"]


def create_prefix_cache(cache_type: str, page_size: int) -> PrefixCache:
    """Build the cache named by `--cache-type`: "radix" shares prefixes, "naive" keeps nothing."""
    caches = {"radix": RadixCache, "naive": NaiveCache}
    if cache_type not in caches:
        raise ValueError(f"unknown cache type {cache_type!r}: expected 'radix' or 'naive'")
    return caches[cache_type](page_size)
