"""Prefill chunks sized to the inter-token latency target (issue 45, item 3): the chunk rule
against values worked out by hand, the cost fit against costs it must recover, and the
scheduler's chunks under given costs."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from minisgl import LLM, SamplingParams
from minisgl.config import AUTO_ITL_DECODE_STEPS, AUTO_ITL_EXTRA_MS
from minisgl.core import Req
from minisgl.scheduler.step_cost import MIN_CHUNK_TOKENS, ChunkCosts, StepCosts, attention_pairs

MAX_STEPS = 200


def test_attention_pairs():
    assert attention_pairs(1, 0) == 1  # a first token attends to itself
    assert attention_pairs(3, 0) == 1 + 2 + 3
    assert attention_pairs(2, 10) == 11 + 12


def test_chunk_within_a_budget_by_hand():
    # token cost alone: 0.1 s / 0.01 s = 10 tokens, wherever the chunk starts
    assert ChunkCosts(token_s=0.01).max_tokens(0.1, 5000) == 10
    # 0.5e-6 n^2 + (0.001 + 1e-6 * 1000.5) n = 0.1 -> n = 49.4: 49 tokens cost 0.049 + 1e-6 *
    # (49,000 + 1,225) = 0.099225 s; 50 would cost 0.05 + 1e-6 * (50,000 + 1,275) = 0.101275 s.
    costs = ChunkCosts(token_s=0.001, pair_s=1e-6)
    assert costs.max_tokens(0.1, 1000) == 49
    assert costs.cost_s(49, 1000) == pytest.approx(0.099225)
    assert costs.cost_s(50, 1000) == pytest.approx(0.101275)
    # later in the prompt the same budget buys fewer tokens: 0.001 + 1e-6 * 7000.5 per token,
    # 0.5e-6 n^2 on top -> n = 12.4
    assert costs.max_tokens(0.1, 7000) == 12
    # no time left, no limit, nothing measured yet
    assert costs.max_tokens(0.0, 0) == 0 and costs.max_tokens(-1.0, 0) == 0
    assert costs.max_tokens(math.inf, 0) > 1 << 40
    assert ChunkCosts().max_tokens(0.1, 0) == MIN_CHUNK_TOKENS


def _batch(*seqs: tuple[int, int]) -> SimpleNamespace:
    """A batch of (tokens, prefix) sequences, as StepCosts reads a ForwardBatch."""
    return SimpleNamespace(extend_lens=[n for n, _ in seqs], prefix_lens=[p for _, p in seqs])


def _stepper(costs: StepCosts) -> Callable[..., None]:
    """run(step_s, *seqs): costs observes a step of the batch `seqs` taking step_s, idle
    before each (no overlap)."""
    now_s = [0.0]

    def run(step_s: float, *seqs: tuple[int, int]) -> None:
        costs.observe(_batch(*seqs), now_s[0] + 1.0, now_s[0] + 1.0 + step_s)
        now_s[0] += 1.0 + step_s

    return run


def test_step_costs_recover_the_costs_they_observe():
    token_s, pair_s, decode_s = 1e-3, 2e-7, 0.05
    costs = StepCosts(None)
    run = _stepper(costs)
    run(decode_s, (1, 40))  # a decode-only step
    assert costs.decode_step_s == pytest.approx(decode_s)
    for n, p in ((100, 0), (100, 1000), (50, 3000), (20, 6000)):  # with the decode beside
        run(decode_s + token_s * n + pair_s * attention_pairs(n, p), (1, 50), (n, p))
    fitted = costs.costs()
    assert fitted.token_s == pytest.approx(token_s, rel=1e-6)
    assert fitted.pair_s == pytest.approx(pair_s, rel=1e-6)
    auto_s = AUTO_ITL_DECODE_STEPS * decode_s + AUTO_ITL_EXTRA_MS / 1000
    assert fitted.budget_s == pytest.approx(auto_s - decode_s)
    assert StepCosts(300).costs().budget_s == 0.3  # nothing measured: no decode step yet
    assert StepCosts(0).costs() == ChunkCosts()  # off


def test_step_time_counts_from_the_previous_result_under_overlap():
    costs = StepCosts(None)
    costs.observe(_batch((1, 10)), launched_s=1.0, done_s=1.2)
    costs.observe(_batch((1, 11)), launched_s=1.1, done_s=1.5)  # launched before 1.2
    assert costs.decode_step_s == pytest.approx(0.2 + 0.2 * (0.3 - 0.2))


def test_one_shape_of_chunk_fits_the_token_cost_alone():
    costs = StepCosts(None)
    for now_s in (1.0, 2.0, 3.0):  # the same chunk every time: the two costs are one
        costs.observe(_batch((1, 5), (64, 0)), now_s, now_s + 0.64)
    fitted = costs.costs()
    assert (fitted.token_s, fitted.pair_s) == (pytest.approx(0.01), 0.0)


def test_chunks_follow_the_costs_only_while_streams_decode(tiny_qwen3):
    """Given costs of 4 ms a token and 0.1 s to spend, a prompt prefills 25 tokens a step
    beside a decoding request, and all at once without one, to the same tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(100, 175))
    llm = LLM(str(tiny_qwen3), dtype="float32", num_pages=1024, cache_type="naive")
    try:
        scheduler = llm.scheduler
        fixed = ChunkCosts(budget_s=0.1, token_s=0.004)
        scheduler.step_costs.costs = lambda: fixed  # type: ignore[method-assign]
        runs = []
        for beside in (None, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)):
            long = Req(f"long-{len(runs)}", prompt, greedy)
            if beside is not None:  # a request decoding when the long prompt comes
                decoding = Req("decoding", [1, 2, 3], beside)
                scheduler.add_request(decoding)
                for _ in range(MAX_STEPS):
                    if decoding.output_ids:
                        break
                    scheduler.step()
            scheduler.add_request(long)
            chunks = []
            for _ in range(MAX_STEPS):
                if long.cached_len >= len(prompt):
                    break
                before = long.cached_len
                scheduler.step()
                chunks.append(long.cached_len - before)
            for _ in range(MAX_STEPS):
                if long.finished:
                    break
                scheduler.step()
            runs.append((chunks, long.output_ids))
        assert runs[0][0] == [75] and runs[1][0] == [25, 25, 25]
        assert runs[1][1] == runs[0][1]
        scheduler.abort_request("decoding")
        scheduler.step()
        llm.check_page_accounting()
    finally:
        llm.shutdown()


def test_small_chunks_after_big_ones_are_predicted_from_their_own_cost():
    """A long prompt prefilled alone in big chunks, then small chunks beside a decode that cost
    more per token (each streams the weights for a few rows): the fit predicts them from their
    own cost (with the big chunks in it, it would predict under half of it)."""
    decode_s, big_token_s, small_token_s, pair_s = 0.02, 2e-3, 5e-3, 2e-8
    costs = StepCosts(None)
    run = _stepper(costs)
    run(decode_s, (1, 40))
    for p in range(0, 8192, 1024):  # alone: no decode in these steps
        run(big_token_s * 1024 + pair_s * attention_pairs(1024, p), (1024, p))
    want_s = small_token_s * 48 + pair_s * attention_pairs(48, 0)
    for _ in range(3):
        run(decode_s + want_s, (1, 9), (48, 0))
    assert costs.costs().cost_s(48, 0) == pytest.approx(want_s, rel=0.1)
