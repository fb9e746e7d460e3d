"""Structured outputs below the server: the sampler's mask, grammar matchers, the scheduler
(overlap, radix, chunking, n, retraction-free finish) and tensor parallelism.

The oracle for "constrained" is the grammar itself: every output must match it (a regex fully
matched, JSON validated against its schema); the oracle for "only constrained rows change" is
the same request run without a constraint.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from minisgl import LLM, SamplingParams
from minisgl.core import Constraint
from minisgl.engine.device import ComputeStream
from minisgl.engine.sampler import Sampler, apply_vocab_mask
from minisgl.engine.sampling_batch import SamplingBatch
from minisgl.grammar import GrammarCompiler, GrammarState, build_vocab_mask
from minisgl.limits import InvalidRequestError
from minisgl.tokenizer import load_tokenizer
from tests.conftest import QWEN3_VOCAB, qwen3_tokenizer_dir

CPU = ComputeStream(torch.device("cpu"))
EOS = 151645
THINK_END = 151668  # "</think>" in the Qwen3 vocabulary
OPTIONS = dict(num_pages=2048, max_running_requests=16, dtype="float32")
REGEX = r"(yes|no)-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
}
PROMPTS = [list(range(300, 340)), list(range(500, 507)), list(range(900, 960))]
MAX_TOKENS = 40


def pack(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    """xgrammar's layout: bit j of word w allows token 32 * w + j."""
    bits = torch.zeros(len(allowed), -(-vocab_size // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bits[row, t // 32] |= 1 << (t % 32)
    # words are int32: a set top bit is a negative number
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def test_sampler_masks_only_the_constrained_rows() -> None:
    vocab = 100  # not a multiple of 32: the last word is padding
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [{5, 17, 31, 32}, {99}]
    params = [SamplingParams(temperature=t, seed=3, logprobs=2) for t in (0.0, 1.0, 0.0, 1.0)]
    sb = SamplingBatch.build(params, [3] * 4, [10] * 4, vocab, CPU)
    sb.mask = (torch.tensor([1, 3]), pack(allowed, vocab))
    masked = apply_vocab_mask(logits, sb)
    assert torch.isinf(masked[1]).sum() == vocab - 4 and torch.isinf(masked[3]).sum() == vocab - 1
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    for seed in range(20):
        sb.rows.seeds = torch.full((4,), seed)
        result = Sampler(torch.device("cpu")).sample(logits, sb)
        assert int(result.token_ids[1]) in allowed[0] and int(result.token_ids[3]) == 99
        assert int(result.token_ids[0]) == int(logits[0].argmax())  # unconstrained: untouched
    # logprobs report the model's own distribution, not the masked one
    assert result.scores is not None
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(result.scores.chosen[3], raw[3, 99])


@pytest.fixture(scope="module")
def qwen3_compiler() -> GrammarCompiler:
    return GrammarCompiler(load_tokenizer(qwen3_tokenizer_dir()), QWEN3_VOCAB, [EOS])


def test_grammar_waits_for_the_end_of_reasoning(qwen3_compiler: GrammarCompiler) -> None:
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    state = GrammarState(qwen3_compiler.compile(Constraint("regex", "ab")), (THINK_END,))
    assert not state.constrains_next
    state.accept([11])
    assert build_vocab_mask([state, None], QWEN3_VOCAB) is None  # reasoning is free text
    state.accept([11, THINK_END])
    mask = build_vocab_mask([None, state], QWEN3_VOCAB)
    assert mask is not None and mask.rows == [1]
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])

    def allowed(token: int) -> bool:
        return bool((int(mask.bitmask[0, token // 32]) >> (token % 32)) & 1)

    assert allowed(a) and not allowed(b) and not allowed(EOS)
    state.accept([11, THINK_END, a])
    state.accept([11, THINK_END, a, b])
    mask = build_vocab_mask([state], QWEN3_VOCAB)
    assert mask is not None and allowed(EOS) and not allowed(a)  # complete: only the stop token


def test_bad_constraints_are_clear_errors(qwen3_compiler: GrammarCompiler) -> None:
    for constraint, fragment in [
        (Constraint("json_schema", '{"type": "foo"}'), "Unsupported type"),
        (Constraint("json_schema", "5"), "object or bool"),
        (Constraint("regex", "(("), "parenthesis"),
        (Constraint("ebnf", 'root ::= "a" | foo'), "not defined"),
    ]:
        with pytest.raises(InvalidRequestError, match=fragment) as info:
            qwen3_compiler.compile(constraint)
        assert info.value.param == "constraint"
    with pytest.raises(InvalidRequestError, match="kind"):
        Constraint("xml", "")


def _text(llm: LLM, ids: list[int]) -> str:
    return str(llm.tokenizer.decode([t for t in ids if t != EOS], skip_special_tokens=True))


def _check_outputs(llm: LLM, outs: list, schema_rows: list[int], regex_rows: list[int]) -> None:
    for i in schema_rows:
        assert outs[i].finish_reason == "stop", outs[i]
        jsonschema.validate(json.loads(_text(llm, outs[i].token_ids)), SCHEMA)
    for i in regex_rows:
        assert outs[i].finish_reason == "stop", outs[i]
        assert re.fullmatch(REGEX, _text(llm, outs[i].token_ids))


def _mixed_params() -> list[SamplingParams]:
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    regex = Constraint("regex", REGEX)
    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, constraint=schema),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),  # unconstrained
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, constraint=regex, logprobs=2),
    ]


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> list[list[int]]:
    with LLM(str(tiny_qwen3), disable_overlap=True, cache_type="naive", **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, _mixed_params())
        _check_outputs(llm, outs, [0], [2])
        plain = llm.generate([PROMPTS[1]], _mixed_params()[1])[0]
        assert outs[1].token_ids == plain.token_ids  # the batch mates' masks did not leak
        llm.check_page_accounting()
        return [o.token_ids for o in outs]


KNOBS = {
    # overlap: the mask of step N+1 is built after step N's tokens are processed
    "overlap_on": dict(overlap="on"),
    "overlap_on_chunk4": dict(overlap="on", max_prefill_tokens=4),
    "radix_page4": dict(cache_type="radix", page_size=4),
    "graph_padding": dict(cuda_graph_max_bs=4),
}


@pytest.mark.parametrize("name", list(KNOBS))
def test_constrained_outputs_do_not_depend_on_knobs(tiny_qwen3, reference, name) -> None:
    with LLM(str(tiny_qwen3), **OPTIONS, **KNOBS[name]) as llm:
        outs = llm.generate(PROMPTS, _mixed_params())
        assert [o.token_ids for o in outs] == reference
        # again: the radix cache now serves the prompts, the grammars start afresh
        assert [o.token_ids for o in llm.generate(PROMPTS, _mixed_params())] == reference
        # n > 1: seeded samples, each under its own matcher
        sampled = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, constraint=c)
            for s in range(4)
            for c in (Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", REGEX))
        ]
        outs = llm.generate([PROMPTS[0]] * len(sampled), sampled)
        _check_outputs(llm, outs, list(range(0, 8, 2)), list(range(1, 8, 2)))
        llm.check_page_accounting()


def test_grammar_starts_after_a_token(tiny_qwen3) -> None:
    """The reasoning gate end to end: the first token is free, the rest follows the regex."""
    with LLM(str(tiny_qwen3), **OPTIONS) as llm:
        free = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        first = llm.generate([PROMPTS[0]], free)[0].token_ids[0]
        gated = Constraint("regex", REGEX, start_after=(first,))
        out = llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, constraint=gated)
        )
        assert out[0].token_ids[0] == first and out[0].finish_reason == "stop"
        assert re.fullmatch(REGEX, _text(llm, out[0].token_ids[1:]))
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(PROMPTS, SamplingParams(constraint=Constraint("regex", "((")))
        assert info.value.param == "constraint"
        assert not llm.scheduler.has_work()  # nothing of the failed call was queued
        llm.check_page_accounting()


def test_tp2_applies_the_same_masks(tiny_qwen3, reference) -> None:
    with LLM(str(tiny_qwen3), tp_size=2, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, _mixed_params())
        assert [o.token_ids for o in outs] == reference
        llm.check_page_accounting()


def test_xgrammar_bitmask_layout_matches_ours() -> None:
    """Our unpacking reads xgrammar's words the way its own kernel does."""
    bits = xgr.allocate_token_bitmask(1, 70)
    xgr.reset_token_bitmask(bits)
    bits[0, 0] = 0b1010  # tokens 1 and 3
    bits[0, 1] = 1 << 5  # token 37
    bits[0, 2] = 0
    logits = torch.zeros(1, 70)
    ours = logits.clone()
    sb = SamplingBatch.build([SamplingParams()], [0], [0], 70, CPU)
    sb.mask = (torch.tensor([0]), bits)
    ours = apply_vocab_mask(ours, sb)
    xgr.apply_token_bitmask_inplace(logits, bits)
    assert torch.equal(torch.isinf(ours), torch.isinf(logits))
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [1, 3, 37]


def test_min_tokens_yield_to_a_finished_grammar(tiny_qwen3) -> None:
    """min_tokens holds EOS off, but a grammar that can only end must end: the constrained
    rows still match (a row of nothing but -inf would draw a token the grammar forbids, and
    the constraint would be dropped); the unconstrained row keeps its minimum."""
    params = _mixed_params()
    held = [dataclasses.replace(p, min_tokens=MAX_TOKENS) for p in params]
    held[1] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    with LLM(str(tiny_qwen3), **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, held)
        _check_outputs(llm, outs, [0], [2])
        assert len(outs[1].token_ids) == MAX_TOKENS and EOS not in outs[1].token_ids
        llm.check_page_accounting()


def test_bans_never_empty_a_row() -> None:
    """apply_bans on a row whose mask allows only the banned token: the row keeps it."""
    from minisgl.engine.sampler import apply_bans

    logits = torch.zeros(2, 8)
    logits[0, 3] = float("-inf")  # row 0 still has other tokens; row 1 allows only token 5
    logits[1] = float("-inf")
    logits[1, 5] = 1.0
    sb = SamplingBatch.build([SamplingParams()] * 2, [0, 0], [0, 0], 8, CPU)
    sb.bans = (torch.tensor([0, 1]), torch.tensor([5, 5]))
    out = apply_bans(logits, sb)
    assert torch.isinf(out[0, 5]) and int(out[0].argmax()) != 5
    assert torch.equal(out[1], logits[1])
