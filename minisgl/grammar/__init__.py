"""Structured outputs: compile a request's `Constraint` with xgrammar and follow its output.

- `GrammarCompiler`: constraint -> compiled grammar, cached by (kind, value). An invalid or
  unsupported constraint raises `InvalidRequestError`. It runs in the API server's compile
  worker, and in the scheduler when a request arrives uncompiled (from the offline `LLM`).
- `GrammarWorker` (the API server): each new constraint compiled in a worker process, bounded
  in size, time and memory, so a bad one is a 400 before anything reaches the scheduler and a
  hostile one cannot take the server down; the serialized grammar is cached and shipped to the
  scheduler, which loads it (a cache hit or a deserialization of a few ms), never compiles it.
- `GrammarState` (the scheduler, one per constrained request): a matcher that advances with
  each accepted token and writes the request's allowed tokens as a packed bitmask row.
"""

from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.state import GrammarState, build_vocab_mask
from minisgl.grammar.worker import GrammarWorker

__all__ = ["GrammarCompiler", "GrammarState", "GrammarWorker", "build_vocab_mask"]
