"""Admission and chunked prefill: which waiting requests start, and how much prompt each step
computes (within `max_prefill_tokens` and, in a step that decodes, the time its `ChunkCosts`
allow). Admission is optimistic: it does not reserve a request's `max_tokens`
(docs/architecture.md#one-requests-life, steps 3 and 4)."""

import math

from minisgl.config import ServerArgs
from minisgl.core import Req
from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.policy import INPUT_TOKEN_WEIGHT, SchedulePolicy
from minisgl.scheduler.step_cost import MIN_CHUNK_TOKENS, ChunkCosts

# Two prompts agreeing on this many leading tokens are taken to share a prefix worth caching.
SHARED_PREFIX_PROBE_LEN = 32
# A prompt whose logprobs are wanted computes logits for every position: [positions, vocab]
# (300 MB in fp32 at Qwen3's 151,936 tokens for 512). One step scores at most this many
# positions, all such requests together; the rest of their prompts waits for later steps.
PROMPT_LOGPROBS_STEP_TOKENS = 512


class PrefillManager:
    def __init__(self, cache: CacheManager, args: ServerArgs, max_prefill_tokens: int) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.max_prefill_tokens = max_prefill_tokens  # the engine's, resolved from args
        self.max_running_requests = args.max_running_requests
        self.share_prefixes = args.cache_type == "radix"  # defer same-step prefix siblings
        self.policy = SchedulePolicy(args, cache.prefix_cache)
        self.waiting: list[Req] = []  # in queue order (the policy's last tie-break)

    def victim(self, running: list[Req]) -> Req | None:
        """Priority scheduling: a running request to retract so that the first waiting request,
        which has no row or too few pages, starts now (one of a lower class), or None."""
        if not self.policy.priority or not self.waiting:
            return None
        head = next(self.policy.order(self.waiting, running))
        return None if self._can_admit(head, len(running)) else self.policy.victim(head, running)

    def schedule(
        self, running: list[Req], costs: ChunkCosts, decoding: bool = False
    ) -> tuple[list[tuple[Req, int]], list[Req]]:
        """This step's prefill work as (request, tokens to compute) pairs: chunks of the prompts
        under way in `running`, then of new admissions; and those admitted (the caller runs
        them). A step that is `decoding` spends at most `costs.budget_s` on them."""
        chunks: list[tuple[Req, int]] = []
        admitted: list[Req] = []
        budget = self.max_prefill_tokens  # prompt tokens this step may still compute
        score_budget = PROMPT_LOGPROBS_STEP_TOKENS  # of those, prompt positions it may score
        budget_s = costs.budget_s if decoding else math.inf  # prefill time left to spend

        def chunk_len(req: Req) -> int:
            # The first chunk moves on whatever the time: the decodes alone may take it all.
            in_time = costs.max_tokens(budget_s, req.cached_len)
            return min(
                req.remaining_prefill_len,
                min(budget, score_budget) if req.scores_prompt else budget,
                in_time if chunks else max(in_time, MIN_CHUNK_TOKENS),
            )

        def add(req: Req, chunk: int) -> None:
            nonlocal budget, score_budget, budget_s
            budget_s -= costs.cost_s(chunk, req.cached_len)
            chunks.append((req, chunk))
            budget -= chunk
            score_budget -= chunk if req.scores_prompt else 0

        # Prompts under way: a cheap filter first, as most running requests decode. The last
        # prompt token is a decode's, unless nothing is sampled after it (max_tokens 0).
        for req in [
            r for r in running if r.device_len - r.cached_len > bool(r.sampling_params.max_tokens)
        ]:
            if budget <= 0:
                break
            if req.finished:
                continue
            chunk = chunk_len(req)
            if chunk == 0:  # a scored prompt with this step's scoring budget spent, or no time
                continue
            if not self.cache.reserve([req], [req.cached_len + chunk]):
                break
            add(req, chunk)
        # Requests whose prompt starts like one admitted in this same step wait one step: by then
        # the first one's prefix is in the radix tree and they compute only their own suffix.
        admitted_keys: set[tuple[int, ...]] = set()
        for req in self.policy.order(self.waiting, running):
            if (
                budget <= 0
                or (chunks and budget_s <= 0)
                or (req.scores_prompt and score_budget <= 0)
                or not self._can_admit(req, len(running) + len(admitted))
            ):
                break
            key = self._prefix_key(req)
            if key is not None and key in admitted_keys:
                continue  # deferred: it keeps its place
            self.cache.admit(req)
            if key is not None and req.cached_len < len(key):
                admitted_keys.add(key)
            chunk = chunk_len(req)
            if chunk == 0 or not self.cache.reserve([req], [req.cached_len + chunk]):
                # No time left, or the estimate was optimistic (its cached prefix got locked):
                # undo, retry later.
                self.cache.release(req)
                break
            self.waiting.remove(req)
            if req.num_retractions == 0:
                self.policy.charge(req, INPUT_TOKEN_WEIGHT * req.prompt_len)
            admitted.append(req)
            add(req, chunk)
        return chunks, admitted

    def _prefix_key(self, req: Req) -> tuple[int, ...] | None:
        """The first tokens of a prompt, to spot requests sharing a prefix in one step."""
        if not self.share_prefixes or req.prompt_len <= SHARED_PREFIX_PROBE_LEN:
            return None
        return tuple(req.input_ids[:SHARED_PREFIX_PROBE_LEN])

    def _can_admit(self, req: Req, num_running: int) -> bool:
        if num_running >= self.max_running_requests or not self.cache.rows.num_free:
            return False
        need_tokens = min(req.prompt_len + len(req.output_ids), self.max_prefill_tokens)
        need_pages = -(-need_tokens // self.page_size) + num_running
        return self.cache.num_available_pages >= need_pages or not num_running
