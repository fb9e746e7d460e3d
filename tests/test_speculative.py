"""Speculative decoding (n-gram drafts): outputs are those of decoding without drafts, token for
token, greedy or seeded; sampled tokens follow the model's distribution (HF transformers'
logits, a chi-square test); pages add up after retraction and aborts."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM

from minisgl import LLM, SamplingParams
from minisgl.config import ServerArgs
from minisgl.core import Req
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.speculative import NgramDrafter
from minisgl.server import parse_server_args
from tests.server_utils import openai_client, require_default_model, running_server

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# One-token matches: a random tiny model's outputs repeat short runs only.
SPEC = {"speculative_algorithm": "ngram", "speculative_ngram_min_match": 1}
MAX_STEPS = 500


def _req(prompt: list[int], outputs: list[int] = ()) -> Req:
    req = Req("r", list(prompt), GREEDY)
    req.output_ids = list(outputs)
    return req


def test_drafter_continues_the_longest_match():
    drafter = NgramDrafter(1, 3, 4)
    #        0  1  2  3  4  5  6  7  8  9
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2]
    # suffix [1, 2] first seen at 8..9 only (the suffix itself): no draft
    assert drafter.drafts(_req(prompt), 4) == []
    # outputs 5, 6: suffix [2, 5, 6] unseen, [5, 6] last at 5..6 -> continues 7, 1, 2, 5
    assert drafter.drafts(_req(prompt, [5, 6]), 4) == [7, 1, 2, 5]
    # then 7, 8: suffix [6, 7, 8] seen at 1..3 (the only 3-gram match) -> 9, 5, 6, 7
    assert drafter.drafts(_req(prompt, [5, 6, 7, 8]), 4) == [9, 5, 6, 7]
    assert drafter.drafts(_req(prompt, [5, 6, 7, 8, 3]), 4) == []  # 3 never seen before
    assert drafter.drafts(_req(prompt, [5, 6, 7, 8, 3, 9]), 2) == [5, 6]  # capped at 2


def test_drafter_follows_an_edit_of_its_source():
    # Copying in order: after a draft from position 1, the occurrence of 1 nearest the source's
    # next position (2) continues, not the latest one (at 5) a new drafter takes.
    prompt = [5, 1, 6, 2, 7, 1, 8]
    drafter = NgramDrafter(1, 1, 4)
    assert drafter.drafts(_req(prompt, [5]), 1) == [1]
    assert drafter.drafts(_req(prompt, [5, 1]), 4) == [6, 2, 7, 1]
    assert NgramDrafter(1, 1, 4).drafts(_req(prompt, [5, 1]), 4) == [8, 5, 1]
    # The model writes 5 where its source has 2 (a rename): later drafts rename 2 likewise.
    drafter = NgramDrafter(1, 1, 4)
    assert drafter.drafts(_req([7, 2, 9, 2], [7]), 4) == [2, 9, 2, 7]
    drafter.verified(4, 0, 5)
    assert drafter.drafts(_req([7, 2, 9, 2], [7, 5]), 4) == []  # (backing off a step)
    assert drafter.drafts(_req([7, 2, 9, 2], [7, 5, 9]), 4) == [5]


def test_drafter_backs_off_after_misses():
    drafter = NgramDrafter(1, 2, 3)
    req = _req([1, 2, 3, 1, 2, 3, 1])
    assert drafter.drafts(req, 4) == [2, 3, 1]
    drafter.verified(3, 0, 9)  # a miss (9 for 2): skip one step, then one draft at most
    assert drafter.drafts(req, 4) == []
    assert drafter.drafts(req, 4) == [9]
    drafter.verified(1, 0, 2)  # a second miss in a row: skip two; 2 is 2 again
    assert [drafter.drafts(req, 4) for _ in range(3)] == [[], [], [2]]
    drafter.verified(1, 1, 3)  # a full hit: all drafts again, and no back-off
    assert drafter.drafts(req, 4) == [2, 3, 1]
    drafter.verified(3, 1, 4)  # one accepted of three (then 4 for 3): two next time
    assert drafter.drafts(req, 4) == [2, 4]
    drafter.verified(2, 0, 8)  # back-off starts over at one step
    assert [drafter.drafts(req, 4) for _ in range(2)] == [[], [8]]


def workload() -> list[list[int]]:
    """Prompts that repeat themselves (drafts get accepted) and random ones."""
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 5000, (n,), generator=g).tolist()

    motif, system = rand(9), rand(40)
    prompts = [motif * 6, system + motif * 3 + rand(5), system + rand(30), rand(120)]
    prompts += [rand(7) * 4, list(prompts[1]), rand(3)]
    return prompts


def run(model_dir, prompts, params=GREEDY, **options) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), **{"dtype": "float32", "num_pages": 2048, **options})
    outs = llm.generate(prompts, params)
    llm.check_page_accounting()
    return outs, llm


@pytest.fixture(scope="module")
def baseline(tiny_qwen3):
    outs, llm = run(tiny_qwen3, workload())
    llm.shutdown()
    return [o.token_ids for o in outs]


KNOBS = {
    "default": {},
    "two_drafts": dict(speculative_num_draft_tokens=2, speculative_ngram_max_match=2),
    "chunk16_page16": dict(max_prefill_tokens=16, page_size=16),
    "graph_padding": dict(cuda_graph_max_bs=8),  # the padded decode path, eagerly on CPU
    "one_running": dict(max_running_requests=1),
    "naive_cache": dict(cache_type="naive"),
}


@pytest.mark.parametrize("name", list(KNOBS))
def test_greedy_outputs_equal_decoding_without_drafts(tiny_qwen3, baseline, name):
    outs, llm = run(tiny_qwen3, workload(), **SPEC, **KNOBS[name])
    try:
        assert [o.token_ids for o in outs] == baseline
        stats = llm.scheduler.stats()
        # drafts were verified, some accepted, some not: both paths ran
        assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
        assert stats.spec_accept_length > 1
        llm.scheduler.flush_cache()
        assert llm.scheduler.cache.allocator.num_free == stats.num_total_pages
    finally:
        llm.shutdown()


def test_tensor_parallel_ranks_draft_alike(tiny_qwen3, baseline):
    """Every rank runs its own scheduler: the drafts come from the same (broadcast) tokens, so
    the ranks' batches stay identical."""
    outs, llm = run(tiny_qwen3, workload(), **SPEC, tp_size=2)
    try:
        assert [o.token_ids for o in outs] == baseline
        assert llm.scheduler.stats().spec_accepted_tokens_total > 0
    finally:
        llm.shutdown()


def test_a_full_cpu_batch_drafts_nothing(tiny_qwen3):
    """On a CPU a draft row costs about what a decoded token does once 16 requests decode
    (benchmark/RESULTS.md, section 27): 16 decoding together draft nothing, 15 do."""
    prompt = workload()[0]  # a motif repeated: every request finds drafts
    for count, drafts in ((16, False), (15, True)):
        outs, llm = run(tiny_qwen3, [prompt] * count, **SPEC, max_prefill_tokens=4096)
        drafted = llm.scheduler.stats().spec_draft_tokens_total
        llm.shutdown()
        assert len({tuple(o.token_ids) for o in outs}) == 1
        assert (drafted > 0) == drafts, (count, drafted)


def test_retraction_keeps_outputs_and_pages(tiny_qwen3, baseline):
    pool_pages = 200  # the longest request (120 + 24 tokens, plus drafts) fits; the batch does not
    outs, llm = run(tiny_qwen3, workload(), **SPEC, num_pages=pool_pages)
    try:
        stats = llm.scheduler.stats()
        assert stats.num_retractions_total > 0 and stats.spec_accepted_tokens_total > 0
        assert [o.token_ids for o in outs] == baseline
        llm.scheduler.flush_cache()
        assert llm.scheduler.cache.allocator.num_free == pool_pages
    finally:
        llm.shutdown()


def test_seeded_sampling_logprobs_and_stops_are_unchanged(tiny_qwen3):
    """Sampling with every processor on: the draws depend on the seed and the position only,
    so drafts change nothing; max_tokens and stop tokens hold at every verified position."""
    prompts = workload()
    often = prompts[0][:3]  # three tokens of the repeated motif, made likely: drafts hit
    params = [
        SamplingParams(
            temperature=0.7 if i % 2 else 0.2,
            top_p=0.95,
            top_k=40,
            min_p=0.01,
            max_tokens=NEW_TOKENS,
            seed=i,
            min_tokens=3,
            logprobs=2,
            repetition_penalty=1.05,
            presence_penalty=0.1,
            frequency_penalty=0.1,
            logit_bias=dict.fromkeys(often, 10.0),
            stop_token_ids=(often[2],) if i % 3 == 0 else (),  # stops inside verify steps
        )
        for i in range(len(prompts))
    ]
    plain, llm = run(tiny_qwen3, prompts, params)
    llm.shutdown()
    spec, llm = run(tiny_qwen3, prompts, params, **SPEC)
    try:
        stats = llm.scheduler.stats()
        assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
        assert any(o.finish_reason == "stop" for o in spec)
        for a, b in zip(plain, spec, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert len(b.token_ids) <= NEW_TOKENS
            assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    finally:
        llm.shutdown()


def test_sampled_tokens_follow_the_model_distribution(tiny_qwen3):
    """Tokens 2 and 3 of many seeded requests, drawn among five tokens (a large logit_bias):
    token 3 is often sampled after a draft in the same verify step. Their joint frequencies
    match the distribution computed from HF transformers' logits (chi-square)."""
    choices = [11, 22, 33, 44, 55]
    prompt = choices * 4  # whatever token 1 is, its successor here becomes a one-token draft
    temperature, num_seeds = 0.8, 1500
    bias = dict.fromkeys(choices, 100.0)
    params = [
        SamplingParams(temperature=temperature, max_tokens=3, seed=s, logit_bias=bias)
        for s in range(num_seeds)
    ]
    # 8 running, each with its draft: a batch of speculative.MAX_VERIFY_ROWS (CPU) would not draft
    outs, llm = run(tiny_qwen3, [prompt] * num_seeds, params, **SPEC, max_running_requests=8)
    stats = llm.scheduler.stats()
    llm.shutdown()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    counts = collections.Counter(tuple(o.token_ids[1:]) for o in outs)

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()

    def next_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, choices].double()
        return torch.softmax(logits / temperature, dim=-1)

    expected = torch.zeros(len(choices), len(choices), dtype=torch.float64)
    p1 = next_probs(prompt)
    for i, t1 in enumerate(choices):
        p2 = next_probs(prompt + [t1])
        for j, t2 in enumerate(choices):
            expected[j] += p1[i] * p2[j] * next_probs(prompt + [t1, t2])
    observed = torch.tensor(
        [[counts[(t2, t3)] for t3 in choices] for t2 in choices], dtype=torch.float64
    )
    assert observed.sum() == num_seeds
    stat = float(((observed - num_seeds * expected) ** 2 / (num_seeds * expected)).sum())
    # P(chi2 with df degrees of freedom > stat) = Q(df / 2, stat / 2)
    df = observed.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-3, (stat, p_value)


def test_aborts_between_verify_steps_keep_pages(tiny_qwen3):
    args = ServerArgs(model=str(tiny_qwen3), dtype="float32", num_pages=512, **SPEC)
    scheduler = Scheduler(args)
    try:
        for i, prompt in enumerate(workload()):
            scheduler.add_request(Req(f"r{i}", prompt, GREEDY))
        aborted = False
        for _ in range(MAX_STEPS):
            if not scheduler.has_work():
                break
            scheduler.step()
            scheduler.check_page_accounting()
            if not aborted and scheduler.counters.spec_accepted_tokens_total > 0:
                for req in list(scheduler.running)[::2]:
                    scheduler.abort_request(req.rid)
                aborted = True
                scheduler.check_page_accounting()
        assert aborted and not scheduler.has_work()
        scheduler.flush_cache()
        assert scheduler.cache.allocator.num_free == 512
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-algorithm", "eagle"], "invalid choice"),
        (["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0"], ">= 1"),
        (["--speculative-ngram-min-match", "3", "--speculative-ngram-max-match", "2"], ">="),
        (["--speculative-algorithm", "ngram", "--overlap", "on"], "without overlap"),
    ],
)
def test_bad_options_are_refused(flags, message, capsys):
    with pytest.raises((ValueError, SystemExit)) as caught:
        parse_server_args(flags)
    assert message in str(caught.value) + capsys.readouterr().err


PASSAGE = (
    "The radix tree keeps every prefix the server has computed. A request that starts with a "
    "cached prefix skips its prefill and computes only the tail. When the pool runs short, the "
    "least recently used leaves are evicted first."
)
MODEL = "SmolLM2-135M-Instruct"  # the bundled model, as the server names it
COPY_MESSAGES = [{"role": "user", "content": f"Copy this text exactly:\n\n{PASSAGE}"}]


def test_server_serves_drafted_outputs_unchanged():
    """A server with --speculative-algorithm ngram on the bundled model (real text that the
    model copies): its greedy replies, streamed or not and cut by a stop string, are what the
    offline engine without drafts writes, and their logprobs bit for bit (a draft row's logits
    are plain decoding's at batch 1); /metrics counts the drafts."""
    require_default_model()
    cases = [dict(max_tokens=48), dict(max_tokens=48, stop=["computes"])]
    with LLM(None) as llm:
        expected = [
            llm.chat([COPY_MESSAGES], SamplingParams(temperature=0, logprobs=0, **case))[0]
            for case in cases
        ]
    with running_server("--speculative-algorithm", "ngram") as srv:
        client = openai_client(srv, timeout_s=120)
        for case, want in zip(cases, expected, strict=True):
            reply = client.chat.completions.create(
                model=MODEL, messages=COPY_MESSAGES, temperature=0, logprobs=True, **case
            )
            assert reply.choices[0].message.content == want.text
            logprobs = [c.logprob for c in reply.choices[0].logprobs.content]
            assert logprobs == [lp.logprob for lp in want.logprobs]
            assert reply.choices[0].finish_reason == want.finish_reason
            assert reply.usage.completion_tokens == len(want.token_ids)
            stream = client.chat.completions.create(
                model=MODEL, messages=COPY_MESSAGES, temperature=0, stream=True, **case
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == want.text
        metrics = srv.metrics()
    assert metrics["minisgl:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["minisgl:spec_accept_length"] > 1
