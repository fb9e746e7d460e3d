"""Constraint -> xgrammar CompiledGrammar, cached: compiled here, or (in the scheduler)
deserialized from what the API server's compile worker sent.

xgrammar is imported when the first compiler is made: processes that never see a constrained
request do not pay for its import.
"""

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from minisgl.core import Constraint
from minisgl.limits import InvalidRequestError

# Grammars kept per process (compiled, or as the JSON the compile worker sends), by count and
# by bytes: most are small, but one can hold tens of MB (a long enum; RESULTS.md section 17).
GRAMMAR_CACHE_SIZE = 128
GRAMMAR_CACHE_BYTES = 256 << 20
# xgrammar compiles a grammar's token masks on this many threads (it defaults to 8).
MAX_COMPILE_THREADS = 8
# JSON is generated compact (", " and ": " separators, no free whitespace): small models given
# free whitespace can emit newlines forever, and the output stays the same JSON value.
ANY_WHITESPACE = False
# What a constraint's kind is called in its error messages.
_KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "structural_tag": "tool call grammar",
}
# xgrammar's errors start with "[time] /path/file.cc:line: "; clients need only the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarCache:
    """An LRU map of grammars, bounded in entries (GRAMMAR_CACHE_SIZE) and in the sum of
    `size_of` its values (GRAMMAR_CACHE_BYTES); the newest entry always stays. One thread uses
    it: the API server's event loop, or a scheduler's."""

    def __init__(self, size_of: Callable[[Any], int]) -> None:
        self._size_of = size_of
        self._entries: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def get(self, key: tuple[str, str]) -> Any:
        if (value := self._entries.get(key)) is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: tuple[str, str], value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > 1 and (
            len(self._entries) > GRAMMAR_CACHE_SIZE
            or sum(map(self._size_of, self._entries.values())) > GRAMMAR_CACHE_BYTES
        ):
            self._entries.popitem(last=False)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width): in the
    API server's compiler process (each compile in a fork of it) and in a scheduler."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        threads = min(MAX_COMPILE_THREADS, os.cpu_count() or 1)
        # Our own cache keys on (kind, value) and also holds deserialized grammars.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache = GrammarCache(lambda grammar: grammar.memory_size_bytes)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (not cached); InvalidRequestError naming `constraint` if it is
        bad (the API server names its request's field instead)."""
        kind, value = constraint.kind, constraint.value
        try:
            if kind in ("json_schema", "json_object"):
                schema = value if kind == "json_schema" else '{"type": "object"}'
                return self._compiler.compile_json_schema(
                    schema, any_whitespace=ANY_WHITESPACE, strict_mode=kind == "json_schema"
                )
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(value)
            return self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            why = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
            message = f"invalid or unsupported {_KIND_NAMES[kind]}: {why}"
            raise InvalidRequestError("constraint", message) from None

    def load(self, constraint: Constraint, grammar_json: str | None) -> Any:
        """The compiled grammar for a request: cached, else deserialized from `grammar_json`
        (compiled by the API server), else compiled here (the offline API sends none)."""
        if (compiled := self._cache.get(constraint.grammar_key)) is None:
            if grammar_json is None:
                compiled = self.compile(constraint)
            else:
                compiled = self._xgr.CompiledGrammar.deserialize_json(grammar_json, self.info)
            self._cache.put(constraint.grammar_key, compiled)
        return compiled
