"""Constraint -> xgrammar CompiledGrammar, cached; serialization for the trip to the scheduler.

xgrammar is imported when the first compiler is made (~0.3 s): processes that never see a
constrained request do not pay for it.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from minisgl.core import Constraint, InvalidRequestError

# Compiled grammars kept per process. One holds a token-mask cache of ~100-250 KB for a
# 50k-150k vocabulary, so this bounds the cache to tens of MB.
GRAMMAR_CACHE_SIZE = 128
# ... and by bytes: a grammar can be far larger (an enum of 10,000 strings: tens of MB).
GRAMMAR_CACHE_BYTES = 256 << 20
# xgrammar compiles a grammar's token masks on this many threads (it defaults to 8).
MAX_COMPILE_THREADS = 8
# JSON is generated compact (", " and ": " separators, no free whitespace): small models given
# free whitespace can emit newlines forever, and the output stays the same JSON value.
ANY_WHITESPACE = False
# xgrammar's errors start with "[time] /path/file.cc:line: "; clients need only the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _clean(message: str) -> str:
    return _XGRAMMAR_PREFIX.sub("", message.strip()).strip()


def _num_bytes(grammar: Any) -> int:
    """A cached grammar's size: serialized (text) or compiled (xgrammar's own count)."""
    return len(grammar) if isinstance(grammar, str) else int(grammar.memory_size_bytes)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width).

    Thread-safe. The API server's compile worker (minisgl.grammar.worker) and the scheduler
    (offline requests) use it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        param: str = "response_format",
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.param = param  # the request field an invalid constraint is reported against
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        # Our own cache below keys on (kind, value) and also holds deserialized grammars.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._serialized: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, cache: OrderedDict, key: tuple[str, str]) -> Any | None:
        with self._lock:
            value = cache.get(key)
            if value is not None:
                cache.move_to_end(key)
            return value

    def _remember(self, cache: OrderedDict, key: tuple[str, str], value: Any) -> None:
        with self._lock:
            cache[key] = value
            cache.move_to_end(key)
            while len(cache) > GRAMMAR_CACHE_SIZE or (
                len(cache) > 1 and sum(map(_num_bytes, cache.values())) > GRAMMAR_CACHE_BYTES
            ):
                cache.popitem(last=False)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar; raises InvalidRequestError naming `self.param` if it is bad."""
        key = constraint.grammar_key
        compiled = self._cached(self._cache, key)
        if compiled is None:
            compiled = self._compile(constraint)
            self._remember(self._cache, key, compiled)
        return compiled

    def _compile(self, constraint: Constraint) -> Any:
        kind, value = constraint.kind, constraint.value
        what = {
            "json_schema": "JSON schema",
            "json_object": "JSON object grammar",
            "regex": "regex",
            "ebnf": "EBNF grammar",
            "structural_tag": "tool call grammar",
        }[kind]
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(
                    value, any_whitespace=ANY_WHITESPACE, strict_mode=True
                )
            if kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=ANY_WHITESPACE, strict_mode=False
                )
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(value)
            return self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(
                self.param, f"invalid or unsupported {what}: {_clean(str(exc))}"
            ) from None

    def serialize(self, constraint: Constraint) -> str:
        """Compile (cached) and serialize, for the scheduler: what TokenizedRequest carries."""
        key = constraint.grammar_key
        text = self._cached(self._serialized, key)
        if text is None:
            text = str(self.compile(constraint).serialize_json())
            self._remember(self._serialized, key, text)
        return text

    def load(self, constraint: Constraint, grammar_json: str | None) -> Any:
        """The compiled grammar for a request: cached, else deserialized from `grammar_json`
        (compiled by the API server), else compiled here (the offline API sends none)."""
        key = constraint.grammar_key
        compiled = self._cached(self._cache, key)
        if compiled is not None:
            return compiled
        if grammar_json is None:
            return self.compile(constraint)
        compiled = self._xgr.CompiledGrammar.deserialize_json(grammar_json, self.info)
        self._remember(self._cache, key, compiled)
        return compiled
