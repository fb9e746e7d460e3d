"""The KV cache: the paged pool of K/V buffers (pool.py), the prefix caches over it (radix.py)."""
