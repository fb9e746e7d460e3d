"""Turn what the user typed after --model into a local checkpoint folder: the bundled default
model when none, a folder as it is, a GGUF file's folder (models/default_model.py), else a hub
id fetched into the HF cache (docs/models.md#hub-ids). Every failure is one line
(`ModelNotFoundError` / `ModelDownloadError`). `checkpoint_files` decides which safetensors files
make up a folder, for the download and the loader alike. No torch here: the launcher uses it."""

import functools
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.config import ServerArgs
from minisgl.models.default_model import default_model_path, gguf_model_path

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_PATTERN = "*.safetensors"
# Everything but the weights. Patterns match top-level files only (see _TOP_LEVEL_ONLY).
METADATA_PATTERNS = (
    CONFIG_FILE,
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
)
# Subfolders hold other formats or copies (original/, onnx/, ...): never download them.
_TOP_LEVEL_ONLY = ["*/*"]
LOCK_DIR = ".locks"
# Without a terminal (server logs) a progress bar prints a line per update: at most this often.
LOG_PROGRESS_INTERVAL_S = 10.0


class ModelNotFoundError(FileNotFoundError):
    pass


class ModelDownloadError(OSError):
    """A hub id could not be fetched; the message is one line naming the cause."""


@dataclass(frozen=True)
class HubOptions:
    revision: str | None = None  # branch, tag or commit; None: the repo's default branch
    download_dir: str | None = None  # cache folder; None: huggingface_hub's (HF_HUB_CACHE)
    offline: bool = False  # cache only (HF_HUB_OFFLINE=1 has the same effect)


def resolve_model_path(model: str | None, hub: HubOptions | None = None) -> Path:
    """None -> the bundled default model; a folder -> itself; else a hub id (see module doc)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_path(path)
    if path.is_dir():
        if not (path / CONFIG_FILE).exists():
            raise ModelNotFoundError(f"model folder {path} has no {CONFIG_FILE}")
        return path
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelNotFoundError(
            f"model '{model}' not found: no folder at {path.resolve()}, and not a hub id"
        ) from None
    return fetch_from_hub(model, hub or HubOptions())


def resolve_model_path_for(args: ServerArgs) -> Path:
    """The checkpoint folder `args` name, with its hub flags (--revision, --download-dir, ...)."""
    return resolve_model_path(
        args.model, HubOptions(args.revision, args.download_dir, args.offline)
    )


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
    if (by_shard := index_shards(model_dir)) is None:
        if not (files := sorted(model_dir.glob(WEIGHTS_PATTERN))):
            raise FileNotFoundError(f"no {WEIGHTS_PATTERN} files in {model_dir}")
        return files
    for shard, tensor_names in sorted(by_shard.items()):
        if not (model_dir / shard).exists():
            raise FileNotFoundError(
                f"checkpoint {model_dir}: shard {shard} is missing; {INDEX_FILE} puts "
                f"'{min(tensor_names)}' (and {len(tensor_names) - 1} more tensors) in it"
            )
    return [model_dir / shard for shard in sorted(by_shard)]


def fetch_from_hub(repo_id: str, hub: HubOptions) -> Path:
    from filelock import FileLock, Timeout
    from huggingface_hub import constants

    if hub.offline or constants.is_offline_mode():
        return _snapshot(repo_id, hub, local_only=True)
    cache = Path(hub.download_dir or constants.HF_HUB_CACHE).expanduser()
    lock_path = cache / LOCK_DIR / f"minisgl--{repo_id.replace('/', '--')}.lock"
    lock = FileLock(str(lock_path))
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(blocking=False)
        waited = False
    except Timeout:
        logger.info("another process is downloading '%s'; waiting for it", repo_id)
        lock.acquire()
        waited = True
    except OSError as exc:  # a read-only cache: nothing can be downloaded into it anyway
        logger.warning("no download lock at %s (%s); going on without one", lock_path, exc)
        return _snapshot(repo_id, hub, local_only=False)
    try:
        if waited:  # the other process has just fetched it: read the cache, no hub requests
            try:
                return _snapshot(repo_id, hub, local_only=True)
            except ModelDownloadError:
                pass  # it failed: try ourselves, and report our own error
        return _snapshot(repo_id, hub, local_only=False)
    finally:
        lock.release()


def _snapshot(repo_id: str, hub: HubOptions, local_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    download = functools.partial(
        snapshot_download,
        repo_id=repo_id,
        cache_dir=hub.download_dir,
        local_files_only=local_only,
        ignore_patterns=_TOP_LEVEL_ONLY,
        tqdm_class=_progress_bar_class(),
    )
    try:
        folder = Path(download(revision=hub.revision, allow_patterns=list(METADATA_PATTERNS)))
        # An index names the shards; without one, any *.safetensors. The snapshot folder is named
        # by its commit: pin it, so a branch that moves meanwhile cannot mix two commits.
        shards = index_shards(folder)
        weights = sorted(shards) if shards is not None else [WEIGHTS_PATTERN]
        download(revision=folder.name, allow_patterns=weights)
    except Exception as exc:
        raise ModelDownloadError(_explain(exc, repo_id, hub, local_only)) from exc
    at = f"'{repo_id}' (revision {folder.name[:12]})"
    if not (folder / CONFIG_FILE).exists():
        raise ModelDownloadError(f"model {at} has no {CONFIG_FILE}: not a transformers checkpoint")
    try:
        checkpoint_files(folder)
    except FileNotFoundError as exc:
        if shards is None:
            raise ModelDownloadError(
                f"model {at} has no {WEIGHTS_PATTERN} weights: minisgl loads safetensors only"
            ) from None
        raise ModelDownloadError(f"model {at} is incomplete in the cache: {exc}") from None
    return folder


def _explain(exc: Exception, repo_id: str, hub: HubOptions, local_only: bool) -> str:
    from huggingface_hub import constants, errors

    endpoint = constants.ENDPOINT
    cache = hub.download_dir or constants.HF_HUB_CACHE
    revision = hub.revision or constants.DEFAULT_REVISION
    if isinstance(exc, errors.GatedRepoError):
        return (
            f"model '{repo_id}' is gated on the hub: accept its terms on the model page, then set "
            "HF_TOKEN to a token of an account with access"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (
            f"model '{repo_id}' not found on the hub ({endpoint}): no such repository, or it is "
            "private and HF_TOKEN grants no access to it"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"model '{repo_id}' has no revision '{revision}' on the hub ({endpoint})"
    if local_only:
        why = "--offline" if hub.offline else "HF_HUB_OFFLINE=1"
        return (
            f"model '{repo_id}' (revision {revision}) is not in the local Hugging Face cache "
            f"({cache}) and downloads are off ({why})"
        )
    if isinstance(exc, errors.LocalEntryNotFoundError):  # the hub unreachable, nothing cached
        cause = exc.__cause__ or exc
        return (
            f"cannot reach the Hugging Face hub at {endpoint} ({type(cause).__name__}), and model "
            f"'{repo_id}' (revision {revision}) is not fully in the local cache ({cache})"
        )
    if isinstance(exc, errors.HfHubHTTPError) and exc.response is not None:
        return f"downloading '{repo_id}' from {endpoint} failed: HTTP {exc.response.status_code}"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"downloading '{repo_id}' from {endpoint} failed: {type(exc).__name__}: {first_line}"


def _progress_bar_class() -> type:
    """tqdm that also shows in logs (huggingface_hub's hides itself without a terminal)."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from tqdm.auto import tqdm

    class DownloadProgress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("disable", are_progress_bars_disabled())
            if not sys.stderr.isatty():
                kwargs.setdefault("mininterval", LOG_PROGRESS_INTERVAL_S)
            super().__init__(*args, **kwargs)

    return DownloadProgress
