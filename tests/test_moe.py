"""Qwen3-MoE against HF transformers: parity at tp 1 and 2, layer placement, router, both weight
layouts (hub: one tensor per expert; transformers 5.x in memory: fused), and bad checkpoints
failing at load with the tensor's name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

from minisgl import LLM
from minisgl.distributed import reset_tp_info, set_tp_info
from minisgl.layers.moe import MoeConfig, SparseMoeBlock, TopKRouter
from minisgl.models.llama import MLP, CausalLM
from minisgl.models.loader import load_weights
from minisgl.models.model_config import load_model_config
from tests.conftest import TINY_MOE, build_tiny_checkpoint
from tests.test_model_parity import NUM_NEW_TOKENS, _prompts, check_against_hf

SMALL_VOCAB = 512  # load-only tests: a small embedding keeps them fast
MAX_POSITIONS = 64
SPARSE_LAYERS = [0, 2]  # TINY_MOE: layer 1 is in mlp_only_layers


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_small")
    return build_tiny_checkpoint(root / "hub", "qwen3_moe", vocab_size=SMALL_VOCAB)


def _fused_copy(hub_dir: Path, out: Path) -> Path:
    """The same weights in transformers 5.x's in-memory layout (experts.gate_up_proj, ...)."""
    out.mkdir()
    hf = AutoModelForCausalLM.from_pretrained(hub_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(out / "model.safetensors"))
    for f in hub_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def _build(model_dir: Path) -> CausalLM:
    model = CausalLM(load_model_config(model_dir), MAX_POSITIONS)
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("tp_size", [1, 2])
def test_qwen3_moe_matches_hf(tiny_moe: Path, tp_size: int) -> None:
    llm = LLM(
        str(tiny_moe),
        dtype="float32",
        num_pages=512,
        page_size=4,
        max_running_requests=8,
        tp_size=tp_size,
    )
    try:
        if tp_size == 1:
            model = llm.scheduler.engine.model
            layers = model.model.layers
            kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
            assert kinds == [i in SPARSE_LAYERS for i in range(len(layers))]
            # The fused CPU decode step covers dense stacks only: experts run op by op.
            assert model.cpu_decode_stack is None
        check_against_hf(tiny_moe, llm, _prompts(), NUM_NEW_TOKENS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("num_layers", "sparse_step", "mlp_only_layers"),
    [(4, 2, []), (4, 1, [0, 3]), (6, 3, [2]), (3, 1, None)],
)
def test_sparse_layers_are_where_hf_puts_them(
    tmp_path: Path, num_layers: int, sparse_step: int, mlp_only_layers: list[int] | None
) -> None:
    cfg = Qwen3MoeConfig(
        vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only_layers, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(cfg)
        ours = CausalLM(load_model_config(tmp_path), MAX_POSITIONS)
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    got = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert got == want
    dense = [layer.mlp for layer, sparse in zip(ours.model.layers, got, strict=True) if not sparse]
    assert all(isinstance(mlp, MLP) for mlp in dense)


def test_config_reads_hub_and_transformers_keys(small_moe: Path, tmp_path: Path) -> None:
    saved = load_model_config(small_moe).moe  # transformers 5.x writes num_local_experts
    assert saved == MoeConfig(
        num_experts=TINY_MOE["num_experts"],
        top_k=TINY_MOE["num_experts_per_tok"],
        intermediate_size=TINY_MOE["moe_intermediate_size"],
        norm_topk_prob=True,
        sparse_step=1,
        mlp_only_layers=(1,),
    )
    raw = json.loads((small_moe / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")  # the hub's Qwen3-30B-A3B spelling
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(tmp_path).moe == saved


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_hf(norm_topk_prob: bool) -> None:
    hidden, experts, top_k = 32, 8, 3
    cfg = Qwen3MoeConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    hf = Qwen3MoeTopKRouter(cfg)
    ours = TopKRouter(hidden, MoeConfig(experts, top_k, 16, norm_topk_prob))
    torch.nn.init.normal_(hf.weight)
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(20, hidden)
    _, want_weights, want_ids = hf(x)
    got_weights, got_ids = ours(x)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights.float())


@pytest.mark.parametrize("tp_rank", [None, 0, 1])
def test_fused_layout_loads_like_the_hub_layout(
    small_moe: Path, tmp_path: Path, tp_rank: int | None
) -> None:
    """Both layouts give identical shards on every rank (tp 2 is simulated: loading needs no
    process group), and the shards are the right slices of HF's weights."""
    fused = _fused_copy(small_moe, tmp_path / "fused")
    hf_state = load_file(str(fused / "model.safetensors"))
    if tp_rank is not None:
        set_tp_info(tp_rank, 2)
    try:
        from_hub, from_fused = _build(small_moe), _build(fused)
    finally:
        reset_tp_info()
    hub_state, fused_state = from_hub.state_dict(), from_fused.state_dict()
    assert hub_state.keys() == fused_state.keys()
    for name, tensor in hub_state.items():
        assert torch.equal(tensor, fused_state[name]), name
    inter = TINY_MOE["moe_intermediate_size"]
    shard = inter if tp_rank is None else inter // 2
    cols = slice(0, shard) if tp_rank is None else slice(tp_rank * shard, (tp_rank + 1) * shard)
    for layer in SPARSE_LAYERS:
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = hf_state[f"{prefix}.gate_up_proj"], hf_state[f"{prefix}.down_proj"]
        ours_gate_up = hub_state[f"{prefix}.gate_up_proj"]
        assert torch.equal(ours_gate_up[:, :shard], gate_up[:, :inter][:, cols])
        assert torch.equal(ours_gate_up[:, shard:], gate_up[:, inter:][:, cols])
        assert torch.equal(hub_state[f"{prefix}.down_proj"], down[:, :, cols])


def test_fused_layout_serves_like_hf(small_moe: Path, tmp_path: Path) -> None:
    fused = _fused_copy(small_moe, tmp_path / "fused")
    with LLM(str(fused), dtype="float32", num_pages=128, max_running_requests=4) as llm:
        prompts = [[t % SMALL_VOCAB for t in p] for p in _prompts()[:3]]
        check_against_hf(small_moe, llm, prompts, 8)


def _set_num_experts(model_dir: Path, num_experts: int) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw["num_local_experts"] = num_experts
    path.write_text(json.dumps(raw))


def test_bad_checkpoints_name_the_tensor(small_moe: Path, tmp_path: Path) -> None:
    # A missing shard: the error names the shard and a tensor the index puts in it.
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(small_moe, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="200KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {shards[1].name} is missing.*'model\."):
        LLM(str(sharded), dtype="float32", num_pages=16)

    # config.json promises more experts than the checkpoint has.
    more = tmp_path / "more"
    shutil.copytree(small_moe, more)
    _set_num_experts(more, 10)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate\.weight': checkpoint "
                       r"\(8, 64\), model \(10, 64\)"):  # fmt: skip
        _build(more)
    # ... or fewer.
    fewer = tmp_path / "fewer"
    shutil.copytree(small_moe, fewer)
    _set_num_experts(fewer, 6)
    with pytest.raises(ValueError, match=r"'model\.layers\.\d\.mlp\.experts\.[67]\..*out of range"):
        _build(fewer)
    # ... in the fused layout, the shape names the tensor.
    fused = _fused_copy(small_moe, tmp_path / "fused")
    _set_num_experts(fused, 10)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj'.*\(8, "):
        _build(fused)

    # One expert tensor missing from an otherwise complete checkpoint.
    holed = tmp_path / "holed"
    shutil.copytree(small_moe, holed)
    state = load_file(str(holed / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(holed / "model.safetensors"))
    missing = r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    with pytest.raises(
        ValueError, match=rf"lacks weights: {missing} \(config.json says num_experts=8"
    ):
        _build(holed)
