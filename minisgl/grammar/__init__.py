"""Structured outputs: compile a request's `Constraint` with xgrammar and follow its output.

Two halves, one per process:
- `GrammarCompiler` (the API server, and the scheduler when a request arrives uncompiled, as
  from the offline `LLM`): constraint -> compiled grammar, cached by (kind, value). An invalid
  or unsupported constraint raises `InvalidRequestError`, so the server answers 400 before
  anything reaches the scheduler. The API server ships the compiled grammar serialized; the
  scheduler loads it (a cache hit or a deserialization of a few ms), never compiles it.
- `GrammarState` (the scheduler, one per constrained request): a matcher that advances with
  each accepted token and writes the request's allowed tokens as a packed bitmask row.
"""

from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.state import GrammarState, build_vocab_mask

__all__ = ["GrammarCompiler", "GrammarState", "build_vocab_mask"]
