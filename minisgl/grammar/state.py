"""One constrained request's grammar matcher, and the batch's packed vocabulary mask."""

import logging
from collections.abc import Sequence
from typing import Any

from minisgl.engine.batch import VocabMask

logger = logging.getLogger(__name__)


class GrammarState:
    """Follows one request's output through its grammar. With `start_after` (a reasoning
    model's `</think>` token ids) the grammar is dormant until the output ends with those ids.
    Advancing depends only on the accepted tokens, so every tensor-parallel rank, fed rank 0's
    tokens, builds the same masks."""

    def __init__(self, compiled: Any, start_after: Sequence[int] = ()) -> None:
        import xgrammar as xgr  # loaded already: the compiled grammar came from it

        self._matcher = xgr.GrammarMatcher(compiled)
        self._start_after = list(start_after)
        self.active = not self._start_after
        self.broken = False  # a token the grammar rejected: constraining stopped

    @property
    def constrains_next(self) -> bool:
        """Whether the next sampled token must follow the grammar."""
        return self.active and not self.broken and not self._matcher.is_terminated()

    def accept(self, output_ids: Sequence[int]) -> None:
        """Advance by the last token of `output_ids` (the request's output so far)."""
        if not self.active:
            self.active = list(output_ids[-len(self._start_after) :]) == self._start_after
        elif self.constrains_next and not self._matcher.accept_token(output_ids[-1]):
            # Cannot happen when the mask was applied; if it does, stop constraining rather
            # than fail the request.
            logger.warning("grammar rejected token %d: constraint dropped", output_ids[-1])
            self.broken = True


def build_vocab_mask(states: Sequence[GrammarState | None], vocab_size: int) -> VocabMask | None:
    """The mask for one batch's sampled rows (states in sampling order; None: unconstrained).
    None when no row is constrained."""
    if states.count(None) == len(states):  # the usual batch, told at C speed
        return None
    rows = {i: s for i, s in enumerate(states) if s is not None and s.constrains_next}
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for index, state in enumerate(rows.values()):
        state._matcher.fill_next_token_bitmask(bitmask, index)
    return VocabMask(list(rows), bitmask)
