"""Native kernels: `cpu` builds and loads the fp32 CPU kernels (csrc/*.c) at first use.

Nothing here imports from the rest of minisgl: layers, attention and the KV pool import it.
"""
