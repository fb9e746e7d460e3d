"""Turn what the user typed after --model into a local checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from minisgl.models.default_model import default_model_path


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(model: str | None) -> Path:
    """None -> the bundled default model; a folder -> itself; else a hub id in the local HF cache.

    Never downloads: this project runs on machines without hub access.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        return path
    try:
        from huggingface_hub import snapshot_download

        cached = Path(snapshot_download(repo_id=model, local_files_only=True))
    except Exception as exc:  # not a repo id, or not in the local cache
        raise ModelNotFoundError(
            f"model '{model}' not found: no local folder at {path.resolve()} and no hub id "
            f"'{model}' in the local Hugging Face cache ({type(exc).__name__})"
        ) from None
    if not (cached / "config.json").exists():
        raise ModelNotFoundError(f"model '{model}' in the HF cache at {cached} has no config.json")
    return cached
