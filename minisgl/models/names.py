"""Which model names the server answers to (kept free of heavy imports: the launcher uses it)."""

from pathlib import Path

from minisgl.config import ServerArgs
from minisgl.models.default_model import DEFAULT_MODEL_NAME


def served_model_name(args: ServerArgs) -> str:
    """The name in /v1/models and in responses: --served-model-name, else --model (a GGUF
    file's name without its folder)."""
    if args.served_model_name or not args.model:
        return args.served_model_name or DEFAULT_MODEL_NAME
    return Path(args.model).name if args.model.endswith(".gguf") else args.model


def accepted_model_names(args: ServerArgs) -> frozenset[str]:
    """Requests may name the served name, the --model string (or its folder name), or the
    bundled default's name."""
    names = {served_model_name(args), DEFAULT_MODEL_NAME}
    if args.model:
        names.update({args.model, Path(args.model).name})
    return frozenset(names)
