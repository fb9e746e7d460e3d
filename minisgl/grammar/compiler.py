"""Constraint -> xgrammar CompiledGrammar, cached: compiled here, or (in the scheduler)
deserialized from what the API server's compile worker sent.

xgrammar is imported when the first compiler is made (~0.3 s): processes that never see a
constrained request do not pay for it.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from minisgl.core import Constraint
from minisgl.limits import InvalidRequestError

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
        self.param = param  # the request field an invalid constraint is reported against
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        # Our own cache below keys on (kind, value) and also holds deserialized grammars.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, key: tuple[str, str], make: Callable[[], Any]) -> Any:
        """The cached grammar for `key`; else `make()` (outside the lock), then cached."""
        with self._lock:
            if (compiled := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = make()
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > GRAMMAR_CACHE_SIZE or (
                len(self._cache) > 1
                and sum(g.memory_size_bytes for g in self._cache.values()) > GRAMMAR_CACHE_BYTES
            ):
                self._cache.popitem(last=False)
        return compiled

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar; raises InvalidRequestError naming `self.param` if it is bad."""
        return self._cached(constraint.grammar_key, lambda: self._compile(constraint))

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
            message = f"invalid or unsupported {what}: {_clean(str(exc))}"
            raise InvalidRequestError(self.param, message) from None

    def load(self, constraint: Constraint, grammar_json: str | None) -> Any:
        """The compiled grammar for a request: cached, else deserialized from `grammar_json`
        (compiled by the API server), else compiled here (the offline API sends none)."""
        if grammar_json is None:
            return self.compile(constraint)
        deserialize = self._xgr.CompiledGrammar.deserialize_json
        return self._cached(constraint.grammar_key, lambda: deserialize(grammar_json, self.info))
