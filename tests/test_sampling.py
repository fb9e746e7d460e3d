"""Sampler behaviour through the offline API and directly on logits."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.device import ComputeStream
from minisgl.engine.sampler import Sampler, seeded_uniform
from minisgl.engine.sampling_batch import SamplingBatch

CPU = ComputeStream(torch.device("cpu"))
sample = Sampler(torch.device("cpu")).sample


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


def test_penalties_equal_the_dense_formula():
    """apply_penalties (sorted histories, one scatter) against the dense formula on the whole
    vocabulary: repeats inside prompt and output, tokens in both, rows of different lengths
    (padded with the vocabulary size), per-row penalties. Bit for bit."""
    from minisgl.engine.sampler import apply_penalties

    g = torch.Generator().manual_seed(3)
    rows, vocab, length = 6, 300, 40
    logits = torch.randn(rows, vocab, generator=g) * 3
    ids = torch.randint(0, 25, (rows, length), generator=g)  # few distinct ids: many repeats
    prompt_lens = torch.tensor([0, 5, 10, 20, 39, 40])
    seq_lens = torch.tensor([12, 40, 30, 25, 40, 40])
    pos = torch.arange(length)[None, :]
    in_seq = pos < seq_lens[:, None]
    sb = SamplingBatch.build([SamplingParams()] * rows, [0] * rows, [0] * rows, vocab, CPU)
    sb.history = (ids.masked_fill(~in_seq, vocab), in_seq & (pos >= prompt_lens[:, None]))
    sb.rows.repetition = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.1, 1.5])
    sb.rows.frequency = torch.tensor([0.0, 0.5, -0.3, 1.0, 2.0, 0.1])
    sb.rows.presence = torch.tensor([0.0, 0.25, 1.0, -1.0, 0.0, 2.0])
    seen = torch.zeros(rows, vocab, dtype=torch.bool)
    counts = torch.zeros(rows, vocab)
    for r in range(rows):
        seen[r, ids[r, : seq_lens[r]]] = True
        for t in ids[r, prompt_lens[r] : seq_lens[r]].tolist():
            counts[r, t] += 1
    penalty = sb.rows.repetition[:, None].expand_as(logits)
    want = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    want = want - sb.rows.frequency[:, None] * counts
    want = want - sb.rows.presence[:, None] * (counts > 0).float()
    assert torch.equal(apply_penalties(logits, sb), want)


def _reference_penalized_greedy(hf, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Greedy decoding on transformers' logits with the penalties written out per token: the
    repetition penalty over prompt and output (HF's convention), frequency and presence over
    the output only (OpenAI's)."""
    ids = list(prompt)
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for tok in set(ids):
            r = sp.repetition_penalty
            logits[tok] = logits[tok] / r if logits[tok] > 0 else logits[tok] * r
        output = ids[len(prompt) :]
        for tok in set(output):
            count = output.count(tok)
            logits[tok] -= sp.frequency_penalty * count + sp.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_penalties_match_a_reference_on_transformers_logits(llm, tiny_qwen3):
    """Rows of one batch with different prompts, lengths and penalties: each row's greedy
    tokens equal the written-out reference's. The prompts hold tokens this model repeats
    (123916, 46484), so counting the prompt where only the output counts, or the reverse,
    changes the tokens (checked: each row's penalties change its output)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    loop = [5, 9, 5, 9, 11] * 3
    prompts = [loop + [123916, 46484], loop, list(range(300, 310)) + loop + [123916]]
    penalties = [
        {"repetition_penalty": 1.6},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [SamplingParams(**{**_asdict(greedy), **p}) for p in penalties]
    plain = llm.generate(prompts, greedy)
    outs = llm.generate(prompts, params)
    for prompt, sp, out, base in zip(prompts, params, outs, plain, strict=True):
        assert out.token_ids != base.token_ids, "the penalties should matter here"
        assert out.token_ids == _reference_penalized_greedy(hf, prompt, sp)


def test_logit_bias_moves_the_draw_not_the_logprobs(llm):
    """+100 forces a token for greedy and sampled rows alike; -100 bans the greedy choice;
    logprobs stay the model's own (as vLLM reports them by default)."""
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    base = llm.generate([PROMPT], greedy)[0]
    forced = {"777": 100}  # JSON-style keys are accepted and stored as ints
    outs = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(**{**_asdict(greedy), "logit_bias": forced}),
            SamplingParams(temperature=1.0, max_tokens=3, seed=5, logit_bias={777: 100}),
        ],
    )
    assert outs[0].token_ids == outs[1].token_ids == [777] * 3
    assert outs[0].logprobs[0].logprob < -1  # the model's own probability of 777 is tiny
    ban = SamplingParams(**{**_asdict(greedy), "logit_bias": {base.token_ids[0]: -100}})
    assert llm.generate([PROMPT], ban)[0].token_ids[0] != base.token_ids[0]
    assert SamplingParams(logit_bias={"9": 1, 3: -2}).logit_bias == ((3, -2.0), (9, 1.0))
    for bad in ({"x": 1}, {1: 101}, {-1: 1}, {1: float("nan")}, [1, 2]):
        with pytest.raises(ValueError, match="^logit_bias:"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="^logit_bias: token id .* outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**8: 1}))


def test_prompt_logprobs_match_transformers(llm, tiny_qwen3):
    """A 600-token prompt (two chunks: scored prompts prefill 512 tokens at a time) scored in a
    batch with a plain request: each prompt token's logprob and top 3 equal transformers'
    log-softmax; max_tokens 0 generates nothing; a prompt already in the prefix cache is
    computed again, so it is scored in full; the plain request is unaffected."""
    from transformers import AutoModelForCausalLM

    from minisgl.scheduler.prefill import PROMPT_LOGPROBS_STEP_TOKENS

    prompt = [(7 * i) % 5000 + 3 for i in range(600)]
    assert len(prompt) > PROMPT_LOGPROBS_STEP_TOKENS
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    want_chosen = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = llm.generate([PROMPT], plain)[0].token_ids
    for attempt in range(2):  # the second time the prompt is in the prefix cache
        scored, other = llm.generate(
            [prompt, PROMPT], [SamplingParams(max_tokens=0, prompt_logprobs=3), plain]
        )
        assert scored.token_ids == [] and scored.finish_reason == "length"
        assert other.token_ids == alone and other.prompt_logprobs == []
        assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
        entries = scored.prompt_logprobs[1:]
        assert [e.token_id for e in entries] == prompt[1:], attempt
        got = torch.tensor([e.logprob for e in entries])
        torch.testing.assert_close(got, want_chosen, atol=1e-4, rtol=0)
        assert [[t for t, _ in e.top] for e in entries] == want.topk(3).indices.tolist()
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=0)


def test_min_tokens_holds_stop_tokens_off(llm):
    """A stop token id the greedy output reaches at its 2nd token: min_tokens 5 keeps it out of
    the first 5 (it is never drawn there), so the reply is longer; EOS the same way."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate([PROMPT], greedy)[0].token_ids
    stop_id = base[1]
    stopped = SamplingParams(**{**_asdict(greedy), "stop_token_ids": [stop_id]})
    assert llm.generate([PROMPT], stopped)[0].token_ids == base[:2]
    held = SamplingParams(**{**_asdict(greedy), "stop_token_ids": [stop_id], "min_tokens": 5})
    out = llm.generate([PROMPT], held)[0]
    assert len(out.token_ids) >= 5 and stop_id not in out.token_ids[:5]
    assert out.token_ids[0] == base[0]  # only the banned token's draws changed
    eos = llm.scheduler.eos_token_ids[0]
    no_eos = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logit_bias={eos: 100})
    assert eos not in llm.generate([PROMPT], no_eos)[0].token_ids
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_max_tokens_ignore_eos_stop_ids_and_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    stop_id = out.token_ids[2]
    stopped = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id])
    )[0]
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert out.stop_reason is None  # length
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


def test_uniforms_never_reach_one():
    """u = 1 makes -log(u) = 0: that token would win every race whatever its probability.
    The extremes of the hash map strictly inside (0, 1); so does every value of a batch that
    hit u = 1.0 in three rows of 200 when 24 bits were kept (a 152k vocabulary)."""
    from minisgl.engine.sampler import _unit_interval

    extremes = _unit_interval(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert bool(((extremes > 0) & (extremes < 1)).all()), extremes.tolist()
    assert bool((-torch.log(extremes) > 0).all())
    u = seeded_uniform(torch.arange(200), torch.zeros(200, dtype=torch.int64), 151936)
    assert u.max().item() < 1 and u.min().item() > 0


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


def _reference_draw(logits: torch.Tensor, params: list[SamplingParams], seeds, positions):
    """The filtered draw spelled out per row: sort the whole vocabulary, zero what top-k, top-p
    and min-p drop, race over every token (what `sample` must equal without sorting)."""

    vocab = logits.shape[-1]
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(int(logits[i].argmax()))
            continue
        probs = torch.softmax(logits[i] / max(p.temperature, 1e-5), dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        drop = torch.arange(vocab) >= (p.top_k if p.top_k > 0 else vocab)
        drop |= sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop |= sorted_probs < p.min_p * sorted_probs[0]
        drop[0] = False
        kept = torch.zeros(vocab).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        u = seeded_uniform(torch.tensor([seeds[i]]), torch.tensor([positions[i]]), vocab)
        out.append(int((kept / -torch.log(u[0])).argmax()))
    return out


@pytest.mark.parametrize("shape", ["flat", "peaked", "mixed"])
def test_filtered_draws_equal_the_sorted_reference(shape, monkeypatch):
    """top-k / top-p / min-p rows drawn among topk candidates (and, on CPU, a short list first)
    pick the tokens of the full-sort reference, mixed with greedy and unfiltered rows. A flat
    distribution's nucleus outgrows the short list (those rows take the long one), a peaked
    one's does not."""
    from minisgl.engine import sampler

    decided = []
    original = sampler._cut_inside
    monkeypatch.setattr(
        sampler, "_cut_inside", lambda *a: decided.append(original(*a)) or decided[-1]
    )
    vocab = 3001
    kinds = [
        dict(temperature=0.0, top_p=0.5),
        dict(temperature=0.8),
        dict(top_k=20),
        dict(top_k=1, temperature=0.7),
        dict(top_p=0.95),
        dict(top_p=0.5, temperature=1.3),
        dict(min_p=0.05),
        dict(top_k=40, top_p=0.9, min_p=0.01, temperature=0.6),
        dict(top_k=700, top_p=0.99),
    ]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(3 * len(kinds))]
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(len(params), vocab, generator=g)
    scales = {"flat": [0.3], "peaked": [6.0], "mixed": [0.3, 6.0]}[shape]
    logits *= torch.tensor([scales[i % len(scales)] for i in range(len(params))])[:, None]
    seeds = [1000 + 7 * i for i in range(len(params))]
    positions = [i * 3 for i in range(len(params))]
    sb = SamplingBatch.build(params, seeds, positions, vocab, CPU)
    assert sb.filter_rows is not None and sb.plain_rows is not None
    got = sample(logits, sb).token_ids.tolist()
    assert got == _reference_draw(logits, params, seeds, positions)
    (rows_decided,) = decided
    # top-k rows (k <= the short list) are decided even when flat
    expect = {"flat": [False, True], "peaked": [True], "mixed": [False, True]}[shape]
    assert sorted(set(rows_decided.tolist())) == expect
