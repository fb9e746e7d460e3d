"""Speculative decoding with n-gram drafts (prompt lookup): guess a request's next tokens by
finding its last few tokens earlier in its own prompt and output, and check the guesses in the
forward that computes its next token anyway. The output is token for token that of decoding
without drafts (docs/speculative.md#what-stays-exactly-the-same); how a verify step runs, and
which requests draft: docs/speculative.md#how-a-verify-step-runs."""

import bisect
import itertools
from collections.abc import Callable, Iterator

from minisgl.config import ServerArgs
from minisgl.core import Req, TokenLogprob
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.counters import SchedulerCounters

# Adaptive drafting, so that text without repetition runs about as fast as without drafts: a
# request proposes at most one draft more than its last verify accepted (all of them again
# after a full hit), and one whose drafts all fail waits a decode step before it drafts again,
# twice as long after each further miss, up to this many.
MAX_BACKOFF_STEPS = 64

# Which requests draft in a batch: a step of R rows costs about (KNEE_ROWS + R) row-costs (the
# weights' read, then each row's compute), so a draft row pays only if it is accepted more often
# than a row's share of the step, R / (KNEE_ROWS + R). A request drafts while its recent
# acceptance (an exponential average, weight ACCEPT_AVERAGE_WEIGHT per verify) is above that;
# below it, the average creeps back up by 1/PROBE_STEPS of its distance to 1 per step without
# drafts, so the request tries again once in a while. KNEE_ROWS is this repository's CPU's
# (benchmark/RESULTS.md, section 16).
KNEE_ROWS = 8
ACCEPT_AVERAGE_WEIGHT = 0.5
PROBE_STEPS = 32

# Rows (decodes plus drafts) a step's drafts may bring its batch to: a batch of this many
# decoding requests drafts nothing. Past the point where a decode step stops being bound by
# reading the weights, a draft row costs about what a decoded token does, and a rejected one is
# pure loss: where that point lies on this repository's CPU is measured in benchmark/RESULTS.md,
# sections 16, 16b and 27. Not measured on a GPU yet, where it lies far higher: there the cap
# stays at its first value (by the engine stream's device: "cpu" or "cuda").
MAX_VERIFY_ROWS = {"cpu": 16, "cuda": 32}

# (its token, its logprob) per sampled row
SampledRow = tuple[int, TokenLogprob | None]
# The scheduler's: sampled tokens into their requests (a request they end takes no more).
TakeTokens = Callable[[list[Req], list[int], list[TokenLogprob | None]], None]


class NgramDrafter:
    """One request's n-grams, each (of min_match .. max_match tokens) -> the positions after its
    occurrences in the request's tokens; indexed as tokens arrive, never rebuilt."""

    def __init__(self, min_match: int, max_match: int, max_drafts: int) -> None:
        self.tokens: list[int] = []  # the request's tokens so far: prompt, then output
        self._lengths = range(max_match, min_match - 1, -1)  # the longest match first
        self._after: dict[tuple[int, ...], int | list[int]] = {}
        self._indexed = 1  # n-grams ending before this position are in `_after`
        # An edit copies its source in order, with changes: a draft continues the occurrence
        # nearest to where the last one was copied from (`_offset`: relative to the end then),
        # with each token the model wrote in place of a draft's source token replaced likewise.
        self._offset = 0
        self._source: list[int] = []  # the last draft before replacements
        self._replaced: dict[int, int] = {}
        self._max_drafts = self._allowed = max_drafts
        self._backoff_steps = 0
        self._wait_steps = 0
        self.accept_rate = 1.0  # of its drafts, lately (optimistic at first)

    def drafts(self, req: Req, room: int, min_accept_rate: float = 0.0) -> list[int]:
        """Up to `room` tokens (fewer after misses) that followed an earlier occurrence of the
        request's longest matching suffix (the latest, or the one nearest the last draft's);
        none when nothing matches (or backing off, or its drafts are accepted less often than
        `min_accept_rate`)."""
        if self.accept_rate < min_accept_rate:
            self.accept_rate += (1.0 - self.accept_rate) / PROBE_STEPS
            return []
        if self._wait_steps > 0:
            self._wait_steps -= 1
            return []
        max_drafts = min(room, self._allowed)
        tokens = self.tokens
        if not tokens:
            tokens += req.input_ids
        tokens += req.output_ids[len(tokens) - req.prompt_len :]
        # The last token ends no indexed n-gram: the suffix must be found before itself.
        for end in range(self._indexed, len(tokens)):
            for n in self._lengths:
                if n <= end:
                    key = tuple(tokens[end - n : end])
                    if isinstance(seen := self._after.get(key), list):
                        seen.append(end)
                    else:  # an int while it occurred once (most do): a list per n-gram costs
                        self._after[key] = end if seen is None else [seen, end]  # the GC time
        self._indexed = len(tokens)
        near = len(tokens) + self._offset  # (at first past the end: the latest occurrence)
        for n in self._lengths:
            if after := self._after.get(tuple(tokens[-n:])) if n <= len(tokens) else None:
                after = after if isinstance(after, list) else [after]
                i = bisect.bisect(after, near)
                at = min(after[max(i - 1, 0) : i + 1], key=lambda p: abs(p - near))
                self._offset = at - len(tokens)
                self._source = tokens[at : at + max_drafts]
                return [self._replaced.get(t, t) for t in self._source]
        return []

    def verified(self, num_drafts: int, num_accepted: int, sampled: int) -> None:
        """`sampled`: the token the model chose after the accepted drafts."""
        if num_accepted < num_drafts:  # it wrote `sampled` where the source had `source`
            source = self._source[num_accepted]
            if self._replaced.pop(source, source) == source:  # (a replacement that failed: gone)
                self._replaced[source] = sampled
        self.accept_rate += ACCEPT_AVERAGE_WEIGHT * (num_accepted / num_drafts - self.accept_rate)
        self._allowed = self._max_drafts if num_accepted == num_drafts else num_accepted + 1
        if num_accepted:
            self._backoff_steps = 0
        else:
            self._backoff_steps = min(2 * self._backoff_steps or 1, MAX_BACKOFF_STEPS)
            self._wait_steps = self._backoff_steps


class NgramSpeculator:
    def __init__(
        self, args: ServerArgs, cache: CacheManager, counters: SchedulerCounters, max_len: int
    ) -> None:
        self.max_drafts = args.speculative_num_draft_tokens
        self._matches = (args.speculative_ngram_min_match, args.speculative_ngram_max_match)
        self._cache = cache
        self._counters = counters
        self._max_len = max_len  # the model's: a request ends there
        self._max_rows = MAX_VERIFY_ROWS[cache.tables.stream.device.type]

    def propose(self, reqs: list[Req]) -> bool:
        """Give each decoding request its drafts for this step (written into the token table
        after its last token); whether any got some."""
        proposed = False
        budget = self._max_rows - len(reqs)  # draft rows left for this step
        min_accept_rate = len(reqs) / (KNEE_ROWS + len(reqs))
        for req in reqs:
            # Room for k drafts: k + 1 tokens may come out of the step.
            room = min(
                self.max_drafts,
                budget,
                req.sampling_params.max_tokens - (req.device_len - req.prompt_len) - 1,
                self._max_len - req.device_len - 1,
            )
            if req.grammar is not None or room <= 0:
                continue
            if req.drafter is None:
                req.drafter = NgramDrafter(*self._matches, self.max_drafts)
            req.drafts = req.drafter.drafts(req, room, min_accept_rate)
            if req.drafts:
                self._cache.tables.write_tokens(req.table_row, req.device_len, req.drafts)
                budget -= len(req.drafts)
                proposed = True
        return proposed

    def verify(self, req: Req, rows: Iterator[SampledRow], take: TakeTokens) -> None:
        """`req`'s 1 + k sampled rows into its output: the token sampled at each position, as
        long as the draft there was the token sampled before it."""
        drafts, req.drafts = req.drafts, []
        verified = list(itertools.islice(rows, 1 + len(drafts)))  # consumed even if skipped
        if req.finished:
            return
        for j, (token_id, logprob) in enumerate(verified):
            if j > 0:  # drafts[j - 1] was right: its KV is the request's, and the token after it
                req.cached_len += 1
                req.device_len += 1
            take([req], [token_id], [logprob])
            if req.finished or j == len(drafts) or token_id != drafts[j]:
                break
        if not drafts or req.drafter is None:
            return
        accepted = j  # the drafts before where it stopped
        self._counters.spec_verify_steps_total += 1
        self._counters.spec_draft_tokens_total += len(drafts)
        self._counters.spec_accepted_tokens_total += accepted
        req.drafter.verified(len(drafts), accepted, token_id)
        if not req.finished:  # (a finished one gave everything back already)
            self._cache.trim(req)
