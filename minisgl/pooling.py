"""Embeddings: how a request's vector is pooled from the final hidden states of its prompt, and
which pooling a model gets (docs/server.md, "Embeddings"). Standard library only: the engine
pools (minisgl.engine.batch), the scheduler adds up the chunks, the API server and `LLM` ask."""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.limits import InvalidRequestError, ModelLimits, check_token_ids

POOLING_MODES = ("mean", "last", "cls")
# sentence-transformers' pooling modes that minisgl serves, as 1_Pooling/config.json names them:
# the value of `pooling_mode` in 5.x and later, a `pooling_mode_<mode>: true` flag before
_SENTENCE_TRANSFORMERS_MODES = {
    "mean": "mean",
    "lasttoken": "last",
    "cls": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class Pooling:
    """An embedding request's vector: the mean of its prompt's final (post-norm) hidden states,
    the last token's or the first token's (cls), L2-normalised when `normalize`."""

    mode: str = "mean"
    normalize: bool = True
    # Matryoshka: the sizes the model may be cut to (config.json's `matryoshka_dimensions`, or
    # any up to hidden_size with `is_matryoshka`: vLLM's names), the model's only; and the size
    # a request keeps (the vector's first `dimensions`, before normalising)
    matryoshka: Sequence[int] = ()
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise InvalidRequestError("pooling", f"mode must be one of {', '.join(POOLING_MODES)}")

    def cut(self, dimensions: int | None) -> "Pooling":
        """A request's pooling, keeping `dimensions` (None: all) if the model may be cut so."""
        if dimensions is not None and dimensions not in self.matryoshka:
            sizes = self.matryoshka
            shown = f"1 to {len(sizes)}" if isinstance(sizes, range) else list(sizes)
            message = f"this model's Matryoshka sizes: {shown or 'none'}"
            raise InvalidRequestError("dimensions", message)
        return Pooling(self.mode, self.normalize, dimensions=dimensions)

    @property
    def reads_prefix(self) -> bool:
        """Whether the vector needs the hidden states of tokens before the last: a cached prefix
        has none, so such a prompt is computed whole (its pages are still cached after)."""
        return self.mode != "last"

    def positions(self, prompt_len: int, start: int, end: int) -> range:
        """Of a prompt chunk's positions [start, end), those whose final states this pooling
        adds up (mean: all of the prompt's, cls: position 0, last: the prompt's last)."""
        first = prompt_len - 1 if self.mode == "last" else 0
        stop = 1 if self.mode == "cls" else prompt_len
        return range(max(first, start), min(stop, end))


def model_pooling(model_dir: Path, mode: str | None = None) -> Pooling:
    """A model's pooling: `mode` (--pooling) when given, else its sentence-transformers layout's
    (modules.json, 1_Pooling/config.json), else mean. Normalised when that layout has a
    Normalize module, or without the layout (the bundled model's, or with --pooling). Its
    Matryoshka sizes from config.json (see Pooling.matryoshka)."""
    layout = None if mode is not None else _sentence_transformers_pooling(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    sizes: Sequence[int] = tuple(config.get("matryoshka_dimensions") or ())
    if not sizes and config.get("is_matryoshka"):
        sizes = range(1, config["hidden_size"] + 1)
    return Pooling(*(layout or (mode or "mean", True)), sizes)


def input_token_ids(
    given: str | Sequence[Any],
    encode: Callable[[str], list[int]],
    limits: ModelLimits,
    keep_len: int | None = None,
) -> list[list[int]]:
    """The embedding inputs (a text, token ids, or a list of either) as token ids, each its last
    `keep_len` (vLLM's truncate_prompt_tokens) if given, each checked: an error names `input[i]`.
    The server's and `LLM.embed`'s one rule."""
    inputs: Sequence[Any] = (
        [given] if isinstance(given, str) or given and isinstance(given[0], int) else given
    )
    if not inputs:
        raise InvalidRequestError("input", "must not be empty")
    prompts = []
    for i, item in enumerate(inputs):
        ids = encode(item) if isinstance(item, str) else list(item)
        prompts.append(ids := ids[-(keep_len or len(ids)) :])
        if not item or len(ids) > limits.max_seq_len:
            message = f"must be 1 to {limits.max_seq_len} tokens long, not {len(ids)}"
            raise InvalidRequestError(f"input[{i}]", message)
        check_token_ids(ids, limits, f"input[{i}]")
    return prompts


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(mode, whether a Normalize module follows) of a sentence-transformers checkpoint, None
    without modules.json; ValueError for a layout minisgl does not serve as written."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = {m["type"].split(".")[-1]: m["path"] for m in json.loads(path.read_text())}
    config = {}
    if "Pooling" in modules:
        config = json.loads((model_dir / modules["Pooling"] / "config.json").read_text())
    # the value of `pooling_mode`, or the name of each `pooling_mode_<mode>` flag set
    modes = [
        v if k == "pooling_mode" else k for k, v in config.items() if "pooling_mode" in k and v
    ]
    known = set(modules) <= {"Transformer", "Pooling", "Normalize"} and len(modes) == 1
    mode = _SENTENCE_TRANSFORMERS_MODES.get(modes[0]) if known else None
    if mode is None:
        raise ValueError(
            f"{path}: modules {sorted(modules)}, pooling {config}: minisgl serves one Pooling "
            "module (mean, lasttoken or cls) and Normalize (--pooling overrides the files)"
        )
    return mode, "Normalize" in modules
