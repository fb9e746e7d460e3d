"""Embeddings offline (`LLM.embed`), against independent oracles: transformers' final hidden
states on the bundled model, sentence-transformers on tiny checkpoints saved in its layout.
Chunks are forced small so that long prompts pool across chunks. The server's /v1/embeddings is
tested in tests/test_server.py, on that module's server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl import LLM
from minisgl.core import SamplingParams
from minisgl.limits import InvalidRequestError
from minisgl.pooling import Pooling, model_pooling
from minisgl.runtime.messages import decode, encode

MIN_COSINE = 0.9999
SMALL_CHUNK_TOKENS = 16  # below the long text's length: it pools across several chunks
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings",
    "A much longer text, so that its prompt takes more than one prefill chunk of the "
    "scheduler, which then has to add up the pooled hidden states of every chunk it computed.",
]


def _cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return F.cosine_similarity(torch.tensor(got), want.float(), dim=-1).tolist()


@pytest.fixture(scope="module")
def bundled(default_model_dir: Path):
    with LLM(str(default_model_dir), max_prefill_tokens=SMALL_CHUNK_TOKENS, num_pages=512) as llm:
        yield llm


def test_bundled_model_pools_transformers_hidden_states(bundled: LLM, default_model_dir: Path):
    """Mean (the default, normalised), last-token and first-token pooling against the HF
    model's final hidden states (after its last norm); batched equals one at a time."""
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert len(ids[2]) > 2 * SMALL_CHUNK_TOKENS
    with torch.no_grad():
        states = [hf.model(torch.tensor([x])).last_hidden_state[0] for x in ids]
    assert bundled.pooling == Pooling("mean", normalize=True)
    wants = {
        "mean": torch.stack([F.normalize(s.mean(0), dim=0) for s in states]),
        "last": torch.stack([s[-1] for s in states]),
        "cls": torch.stack([s[0] for s in states]),
    }
    for mode, want in wants.items():
        pooling = Pooling(mode, normalize=mode == "mean")
        got = bundled.embed(TEXTS, None if mode == "mean" else pooling)
        assert min(_cosines(got, want)) >= MIN_COSINE, mode
        if mode != "mean":  # not normalised: the vector itself
            assert torch.allclose(torch.tensor(got), want, atol=1e-3), mode
        one_by_one = [bundled.embed([text], pooling)[0] for text in TEXTS]
        assert torch.allclose(torch.tensor(one_by_one), torch.tensor(got), atol=1e-5), mode
    assert bundled.embed(ids[1]) == bundled.embed([TEXTS[1]])  # token ids as a prompt
    bundled.check_page_accounting()


def test_embeddings_batch_with_generation_and_reuse_the_cache(bundled: LLM):
    """Embedding requests in one batch with a generation change neither; a prompt embedded
    again (its pages now cached) pools the same; pages add up after."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    alone = bundled.generate([TEXTS[2]], greedy)[0].token_ids
    pooled = {mode: bundled.embed(TEXTS, Pooling(mode)) for mode in ("mean", "last")}
    embed = [SamplingParams(max_tokens=0, pooling=Pooling("last"))] * len(TEXTS)
    mixed = bundled.generate([TEXTS[2], *TEXTS], [greedy, *embed])
    assert mixed[0].token_ids == alone and mixed[0].embedding is None
    got = [out.embedding for out in mixed[1:]]
    assert torch.allclose(torch.tensor(got), torch.tensor(pooled["last"]), atol=1e-5)
    # `last` reuses a cached prefix, `mean` computes the prompt whole: both pool the same
    for mode, first in pooled.items():
        again = bundled.embed(TEXTS, Pooling(mode))
        assert torch.allclose(torch.tensor(again), torch.tensor(first), atol=1e-5), mode
    bundled.check_page_accounting()


def test_max_tokens_zero_prompt_ending_in_a_one_token_chunk(tiny_qwen3: Path):
    """A prompt that computes nothing after it (prompt logprobs, max_tokens 0) whose chunks
    leave one token for last: that token is a prefill chunk, not a decode (it once hung)."""
    with LLM(str(tiny_qwen3), max_prefill_tokens=4, num_pages=128) as llm:
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=0, prompt_logprobs=0))
        assert len(out[0].prompt_logprobs) == 5 and out[0].finish_reason == "length"
        llm.check_page_accounting()


@pytest.fixture(scope="module")
def plain_qwen3(tiny_qwen3: Path, tmp_path_factory) -> Path:
    """The tiny Qwen3 without a chat template: sentence-transformers (5.x and later) renders
    plain text through one where the tokenizer has it, which minisgl does not."""
    path = tmp_path_factory.mktemp("st") / "qwen3"
    shutil.copytree(tiny_qwen3, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_sentence_transformers_layout(plain_qwen3: Path, tmp_path: Path, mode: str):
    """A checkpoint saved by sentence-transformers (its base model, Pooling and, except for
    cls, Normalize modules) embeds as SentenceTransformer.encode does."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st

    transformer = st.Transformer(str(plain_qwen3))
    modules = [transformer, st.Pooling(transformer.get_embedding_dimension(), mode)]
    if mode != "cls":
        modules.append(st.Normalize())
    SentenceTransformer(modules=modules).save(str(tmp_path))
    want = torch.tensor(SentenceTransformer(str(tmp_path)).encode(TEXTS))
    expected = Pooling({"lasttoken": "last"}.get(mode, mode), normalize=mode != "cls")
    assert model_pooling(tmp_path) == expected
    assert model_pooling(tmp_path, "last") == Pooling("last")  # the flag overrides the files
    with LLM(str(tmp_path), max_prefill_tokens=4, num_pages=256) as llm:
        got = llm.embed(TEXTS)
        llm.check_page_accounting()
    assert min(_cosines(got, want)) >= MIN_COSINE
    assert torch.allclose(torch.tensor(got).norm(dim=1), want.norm(dim=1), rtol=1e-4)


def test_matryoshka_dimensions(plain_qwen3: Path, tmp_path: Path):
    """A model whose config.json says `is_matryoshka` (vLLM's name) embeds in fewer dimensions
    as SentenceTransformer.encode(truncate_dim=..., normalize_embeddings=True) does: the
    first ones, renormalised; a size past hidden_size, or any for another model, is refused."""
    from sentence_transformers import SentenceTransformer

    shutil.copytree(plain_qwen3, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"is_matryoshka": True}))
    st_model = SentenceTransformer(str(tmp_path))  # a bare Qwen3 folder: last-token pooling
    want = torch.tensor(st_model.encode(TEXTS, truncate_dim=8, normalize_embeddings=True))
    with LLM(str(tmp_path), num_pages=256, pooling="last") as llm:
        got = llm.embed(TEXTS, llm.pooling.cut(8))
        # what the API sends the scheduler: the request's size, not the model's list
        assert decode(encode(llm.pooling.cut(8))) == Pooling("last", True, (), 8)
        with pytest.raises(InvalidRequestError, match=f"1 to {config['hidden_size']}$"):
            llm.pooling.cut(config["hidden_size"] + 1)
    assert torch.tensor(got).shape == (len(TEXTS), 8)
    assert min(_cosines(got, want)) >= MIN_COSINE
    assert torch.allclose(torch.tensor(got).norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    with pytest.raises(InvalidRequestError, match="none"):
        model_pooling(plain_qwen3).cut(8)


def test_unsupported_sentence_transformers_pooling(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")  # a model folder's (models/resolve.py)
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"path": "", "type": "x.Transformer"}, {"path": "1_Pooling", "type": "x.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="--pooling"):
        model_pooling(tmp_path)
    assert model_pooling(tmp_path, "cls") == Pooling("cls")  # the flag overrides the file
    old = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(old))
    assert model_pooling(tmp_path) == Pooling("mean", normalize=False)  # no Normalize module
    (tmp_path / "modules.json").unlink()  # no sentence-transformers layout: the default
    assert model_pooling(tmp_path) == Pooling("mean", normalize=True)
