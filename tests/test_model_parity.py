"""minisgl against the oracle: HF transformers' own forward on the same checkpoint.

Logits are compared through logprobs (log-softmax of the logits: the top-k values and the chosen
token's), for the prefill step and every decode step; greedy tokens must equal HF generate.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from minisgl import LLM, SamplingParams
from tests.conftest import qwen3_tokenizer_dir

LOGPROB_ATOL = 2e-4  # fp32; batch composition changes rounding slightly
NUM_NEW_TOKENS = 16
TOP_K = 5


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 5000, (40,), generator=g).tolist()
    return [
        torch.randint(0, 5000, (7,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (9,), generator=g).tolist(),
        shared + torch.randint(0, 5000, (23,), generator=g).tolist(),
        torch.randint(0, 5000, (64,), generator=g).tolist(),
        [42],
    ]


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(model_dir, llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, f"greedy tokens differ for prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
        ref_lp = _hf_logprobs(hf, prompt + out.token_ids)
        assert len(out.logprobs) == new_tokens
        for step, lp in enumerate(out.logprobs):
            row = ref_lp[len(prompt) - 1 + step]  # distribution that produced token `step`
            assert lp.token_id == out.token_ids[step]
            assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=LOGPROB_ATOL)
            top_vals, top_ids = row.topk(TOP_K)
            assert [t for t, _ in lp.top][:1] == top_ids.tolist()[:1]
            got = torch.tensor([v for _, v in lp.top])
            assert torch.allclose(got, top_vals, atol=LOGPROB_ATOL), (step, got, top_vals)
    llm.check_page_accounting()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_models, arch):
    llm = LLM(
        str(tiny_models[arch]), dtype="float32", num_pages=512, page_size=4, max_running_requests=8
    )
    try:
        check_against_hf(tiny_models[arch], llm, _prompts(), NUM_NEW_TOKENS)
        stats = llm.scheduler.stats()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage_ratio == 0.0
    finally:
        llm.shutdown()


def test_rope_scaling_variants_load_and_match(tmp_path):
    """llama3 and linear/yarn scaled rope give the same tokens as HF's implementation."""
    from tests.conftest import build_tiny_checkpoint

    scalings = {
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
        "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "yarn": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_theta": 10000.0,
        },
    }
    for name, rope in scalings.items():
        path = build_tiny_checkpoint(tmp_path / name, "llama", rope_parameters=rope)
        llm = LLM(str(path), dtype="float32", num_pages=256, page_size=1, max_running_requests=4)
        try:
            check_against_hf(path, llm, _prompts()[:2], 8)
        finally:
            llm.shutdown()


SMOL_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Give me three tips for learning Python.",
]


def test_smollm2_chat_greedy_matches_hf_generate(default_model_dir):
    """The bundled model: 32 greedy tokens of real chat prompts equal HF generate's text."""
    llm = LLM(None, dtype="float32", num_pages=2048, max_running_requests=8)
    try:
        hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
        messages = [[{"role": "user", "content": c}] for c in SMOL_CHATS]
        outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))
        for m, out in zip(messages, outs, strict=True):
            ids = llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
            with torch.no_grad():
                ref = hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=32,
                    do_sample=False,
                )[0, len(ids) :]
            ref_text = llm.tokenizer.decode(ref, skip_special_tokens=True)
            assert out.text == ref_text
            assert out.token_ids == ref.tolist()
            assert out.finish_reason in ("stop", "length")
        llm.check_page_accounting()
    finally:
        llm.shutdown()


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_models):
    """A checkpoint saved in several safetensors shards gives the same tokens."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="5MB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, sharded / f.name)
    llm = LLM(str(sharded), dtype="float32", num_pages=256, max_running_requests=4)
    try:
        check_against_hf(tiny_models["llama"], llm, _prompts()[:2], 8)
    finally:
        llm.shutdown()
