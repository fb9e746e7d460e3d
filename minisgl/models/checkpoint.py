"""Which safetensors files make up a checkpoint folder (no torch: the launcher uses it too)."""

from __future__ import annotations

import json
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_PATTERN = "*.safetensors"


def index_shards(model_dir: Path) -> dict[str, list[str]] | None:
    """shard file -> the tensor names the index puts in it; None when there is no index."""
    index_path = model_dir / INDEX_FILE
    if not index_path.exists():
        return None
    weight_map: dict[str, str] = json.loads(index_path.read_text()).get("weight_map", {})
    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor_name)
    return by_shard


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read: the index's shards when there is an index, else all.

    Raises FileNotFoundError naming a tensor of the first missing shard, or when there are none.
    """
    by_shard = index_shards(model_dir)
    if by_shard is None:
        files = sorted(model_dir.glob(WEIGHTS_PATTERN))
        if not files:
            raise FileNotFoundError(f"no {WEIGHTS_PATTERN} files in {model_dir}")
        return files
    for shard, tensor_names in sorted(by_shard.items()):
        if not (model_dir / shard).exists():
            raise FileNotFoundError(
                f"checkpoint {model_dir}: shard {shard} is missing; {INDEX_FILE} puts "
                f"'{min(tensor_names)}' (and {len(tensor_names) - 1} more tensors) in it"
            )
    return [model_dir / shard for shard in sorted(by_shard)]
