"""Bad input fails at the edge with a ValueError naming the field; nothing else breaks."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from tests.conftest import QWEN3_VOCAB


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_the_engine_working(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), num_pages=512, max_running_requests=4)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        good = llm.generate([[1, 2, 3]], sp)[0].token_ids
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[1, 2, 3], []], sp)
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([""], sp)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3], [10**9]], sp)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[-1]], sp)
        with pytest.raises(ValueError, match="context length"):
            llm.generate([[1] * 1020], SamplingParams(max_tokens=10))
        # The server's rules (minisgl.limits), applied to LLM too: the KV pool holds 512 tokens.
        with pytest.raises(ValueError, match="^prompt: .*KV cache capacity is 512"):
            llm.generate([[1] * 600], SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="^top_k: must be at most the vocabulary size"):
            llm.generate([[1, 2, 3]], SamplingParams(top_k=QWEN3_VOCAB + 1, max_tokens=2))
        assert len(llm.generate([[1, 2, 3]], SamplingParams(top_k=QWEN3_VOCAB))[0].token_ids)
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate([[1], [2]], [sp])
        with pytest.raises(TypeError, match="unknown option"):
            LLM(str(tiny_qwen3), not_an_option=1)
        # Nothing was queued by the failed calls, and the engine still answers the same.
        assert not llm.scheduler.has_work()
        assert llm.generate([[1, 2, 3]], sp)[0].token_ids == good
        llm.check_page_accounting()
    finally:
        llm.shutdown()


def test_missing_model_gives_one_clear_line(tmp_path):
    from minisgl.models.resolve import (
        HubOptions,
        ModelDownloadError,
        ModelNotFoundError,
        resolve_model_path,
    )

    offline = HubOptions(download_dir=str(tmp_path / "cache"), offline=True)
    with pytest.raises(
        ModelDownloadError, match="'Qwen/NoSuchModel'.*not in the local .*--offline"
    ):
        resolve_model_path("Qwen/NoSuchModel", offline)
    with pytest.raises(ModelNotFoundError, match="no folder at .*not a hub id"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path / "empty"))
