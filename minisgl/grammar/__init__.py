"""Structured outputs: `GrammarCompiler` compiles a request's `Constraint` with xgrammar
(cached); `GrammarWorker` runs the API server's compiles in a worker process bounded in size,
time and memory, and ships the serialized grammar to the scheduler; `GrammarState` follows one
request's output and writes its allowed tokens into the batch's packed bitmask.
"""

from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.state import GrammarState, build_vocab_mask
from minisgl.grammar.worker import GrammarWorker

__all__ = ["GrammarCompiler", "GrammarState", "GrammarWorker", "build_vocab_mask"]
