"""Sampler behaviour through the offline API and directly on logits."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.device import Device
from minisgl.engine.sampler import SamplingBatch, sample, seeded_uniform

CPU = Device(torch.device("cpu"))


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(str(tiny_qwen3), num_pages=2048, max_running_requests=16)
    yield engine
    engine.check_page_accounting()
    engine.shutdown()


PROMPT = list(range(300, 340))


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].token_ids
    mates = [list(range(500, 500 + n)) for n in (5, 50, 90)]
    other = SamplingParams(temperature=0.7, max_tokens=20, seed=7, ignore_eos=True)
    in_batch = llm.generate(mates + [PROMPT] + mates, [other] * 3 + [sp] + [other] * 3)
    assert in_batch[3].token_ids == alone
    different_seed = llm.generate([PROMPT], SamplingParams(**{**_asdict(sp), "seed": 99}))
    assert different_seed[0].token_ids != alone


def _asdict(sp: SamplingParams) -> dict:
    import dataclasses

    return dataclasses.asdict(sp)


def test_unseeded_sampling_varies_and_greedy_limits_agree(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    top1 = llm.generate([PROMPT], SamplingParams(top_k=1, max_tokens=8, seed=3))[0].token_ids
    tiny_p = llm.generate([PROMPT], SamplingParams(top_p=1e-6, max_tokens=8, seed=3))[0].token_ids
    full_min_p = llm.generate([PROMPT], SamplingParams(min_p=1.0, max_tokens=8))[0].token_ids
    assert greedy == top1 == tiny_p == full_min_p
    hot = SamplingParams(temperature=5.0, max_tokens=8, ignore_eos=True)
    draws = {tuple(o.token_ids) for o in llm.generate([PROMPT] * 4, hot)}
    assert len(draws) > 1


def test_penalties_change_greedy_output(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for field in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = 1.8 if field == "repetition_penalty" else 2.0
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **{field: value})
        out = llm.generate([PROMPT], sp)[0]
        assert out.token_ids != base[0].token_ids, field
    # A strong frequency penalty forbids repeats the base output has.
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    out = llm.generate([PROMPT], sp)[0].token_ids
    assert len(set(out)) >= len(set(base[0].token_ids))


def test_max_tokens_ignore_eos_stop_ids_and_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    stop_id = out.token_ids[2]
    stopped = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id])
    )[0]
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"
    lp = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=4))[0]
    assert len(lp.logprobs) == 3
    for entry, tok in zip(lp.logprobs, lp.token_ids, strict=True):
        assert entry.token_id == tok and entry.logprob <= 0
        assert len(entry.top) == 4
        assert entry.top[0][0] == tok  # greedy: the chosen token is the most likely
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)


def test_stop_strings_offline(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate([PROMPT], sp)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([PROMPT], SamplingParams(**{**_asdict(sp), "stop": [stop]}))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_seeded_uniform_is_a_pure_function_in_open_unit_interval():
    seeds = torch.tensor([1, 1, 2])
    positions = torch.tensor([5, 6, 5])
    u = seeded_uniform(seeds, positions, 1000)
    assert u.shape == (3, 1000) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, seeded_uniform(seeds, positions, 1000))
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_sampling_frequencies_follow_probabilities():
    """Exponential-race draws over many seeds reproduce the softmax distribution."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 4000
    logits = probs.log().repeat(rows, 1)
    sp = [SamplingParams(temperature=1.0)] * rows
    sb = SamplingBatch.build(sp, list(range(rows)), [0] * rows, 4, CPU)
    counts = torch.bincount(sample(logits, sb).token_ids, minlength=4).float() / rows
    assert torch.allclose(counts, probs, atol=0.03), counts
    # top_p=0.6 keeps the two tokens needed to reach 0.6 mass, renormalized.
    sb = SamplingBatch.build(
        [SamplingParams(top_p=0.6)] * rows, list(range(rows)), [0] * rows, 4, CPU
    )
    counts = torch.bincount(sample(logits, sb).token_ids, minlength=4).float() / rows
    assert torch.allclose(counts, torch.tensor([0.625, 0.375, 0, 0]), atol=0.03), counts
