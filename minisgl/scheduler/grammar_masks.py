"""Structured outputs in the scheduler: each constrained request's grammar matcher, each batch's
vocabulary mask, and when that mask must wait for the previous batch (under overlap, N+1's
sampling waits until N is processed: docs/architecture.md#structured-outputs)."""

from typing import Any

from minisgl.core import Req
from minisgl.engine.batch import ForwardBatch, VocabMask
from minisgl.grammar import GrammarCompiler, GrammarState, build_vocab_mask
from minisgl.tokenizer import load_tokenizer


class GrammarMasks:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._vocab_size = vocab_size
        # It reads the whole vocabulary (seconds): made before a server serves (`prepare`), else
        # at the first constrained request.
        self._new_compiler = lambda: GrammarCompiler(
            load_tokenizer(tokenizer_path), vocab_size, eos_token_ids
        )
        self._compiler: GrammarCompiler | None = None

    def prepare(self) -> GrammarCompiler:
        """The compiler, made now if it is not yet (a server's rank 0 does before serving, so
        that no step does)."""
        self._compiler = self._compiler or self._new_compiler()
        return self._compiler

    def compiled(self, req: Req) -> Any:
        """The request's compiled grammar (None when it has no constraint); a bad constraint
        raises here. Cached: the second call for a request costs a lookup."""
        if (constraint := req.sampling_params.constraint) is None:
            return None
        return self.prepare().load(constraint, req.grammar_json)

    def attach(self, req: Req) -> None:
        """Give a constrained request the matcher that follows its output."""
        if (compiled := self.compiled(req)) is not None:
            assert req.sampling_params.constraint is not None
            req.grammar = GrammarState(compiled, req.sampling_params.constraint.start_after)
            req.grammar_json = None  # loaded: the serialized copy is not needed any more

    def mask(self, sampled: list[Req]) -> VocabMask | None:
        """The mask of a batch's sampled requests (in sampling order); None: none constrained."""
        # A finished request's grammar is None (the scheduler clears it).
        return build_vocab_mask([r.grammar for r in sampled], self._vocab_size)

    @staticmethod
    def must_wait(previous: ForwardBatch, batch: ForwardBatch) -> bool:
        """Whether a constrained request sampled in `batch` has its previous token still in
        flight (sampled in `previous`, not processed yet)."""
        in_flight = {id(r) for r in previous.rows if r.grammar is not None}
        return any(id(r) in in_flight for r in batch.rows if r.grammar is not None)
