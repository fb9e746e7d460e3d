"""`python -m minisgl.server [flags]`: the OpenAI-compatible server; `--shell` chats instead;
`--dp N` runs N replicas behind the SGLang Model Gateway.

Every flag is checked here, before anything loads: a bad value is one line naming the flag and
its allowed range (exit code 2), in the first second.
"""

import argparse
import importlib.metadata
import importlib.util
import shlex
import socket
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from minisgl.config import (
    CHOICES,
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_ROUTER_POLICY,
    ROUTER_POLICIES,
    DataParallelArgs,
    ServerArgs,
)
from minisgl.core import SamplingParams

# Aliases users of Mini-SGLang / SGLang / vLLM type.
_ALIASES: dict[str, list[str]] = {
    "model": ["--model-path"],
    "tp_size": ["--tp"],
    "cache_type": ["--cache"],
    "max_model_len": ["--context-length"],
    "max_running_requests": ["--max-num-seqs"],
    "max_prefill_tokens": ["--chunked-prefill-size", "--max-num-batched-tokens"],
    "request_timeout_s": ["--request-timeout"],
    "grammar_compile_timeout_s": ["--grammar-compile-timeout"],
    "shutdown_timeout_s": ["--shutdown-timeout"],
    # SGLang's longer names
    "speculative_ngram_min_match": ["--speculative-ngram-min-match-window-size"],
    "speculative_ngram_max_match": ["--speculative-ngram-max-match-window-size"],
}


DESCRIPTION = f"""Serve a model over OpenAI's, Anthropic's and SGLang's HTTP APIs: chat and text
completions, Responses, Messages, /generate (docs/server.md). With no flags it serves the bundled
SmolLM2-135M-Instruct on http://{DEFAULT_HOST}:{DEFAULT_PORT}. `--shell` chats in this terminal."""
# The shell's reply cap and repetition guard: Ollama's repeat_penalty 1.1 (minisgl's, like
# vLLM's, covers the whole conversation) and a frequency penalty on the reply's own tokens; with
# neither, the bundled model loops on some ordinary questions (benchmark/RESULTS.md section 29).
SHELL_MAX_TOKENS = 1024
SHELL_REPETITION_PENALTY = 1.1
SHELL_FREQUENCY_PENALTY = 0.3
# The shell's sampling flags, named as SamplingParams' fields (whose rules check them).
SHELL_SAMPLING = ("max_tokens", "temperature", "top_p", "repetition_penalty", "frequency_penalty")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag and the rule, not the whole usage."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_arg_parser() -> argparse.ArgumentParser:
    usage = "%(prog)s [options]"
    parser = _Parser(prog="python -m minisgl.server", usage=usage, description=DESCRIPTION)
    groups: dict[str, Any] = {}  # in the order ServerArgs' fields first name them
    for f in fields(ServerArgs):
        if (name := f.metadata["group"]) not in groups:
            groups[name] = parser.add_argument_group(name)
        group = groups[name]
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        shown = f.default is not None and not isinstance(f.default, bool)
        help_text = f.metadata["help"] + (" (default: %(default)s)" if shown else "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        if isinstance(f.default, bool):
            group.add_argument(*flags, action="store_true", **kwargs)
            continue
        type_name = str(f.type)
        kind = int if "int" in type_name else float if "float" in type_name else str
        kwargs["type"] = kind
        if kind is not str:
            kwargs["metavar"] = "N" if kind is int else "X"
        if f.name in CHOICES:
            kwargs["choices"] = list(CHOICES[f.name])
        group.add_argument(*flags, **kwargs)
    shell = parser.add_argument_group(
        "shell",
        "Every reply ends: at the model's end of turn, or cut at --shell-max-tokens (a cut or "
        "Ctrl-C'd reply is left out of the history). The penalties guard against loops, as "
        "llama.cpp's and Ollama's chat defaults do.",
    )
    shell.add_argument("--shell", action="store_true", help="chat in this terminal (/exit quits)")
    shell.add_argument(
        "--shell-max-tokens",
        dest="max_tokens",
        type=int,
        metavar="N",
        default=SHELL_MAX_TOKENS,
        help="longest reply in tokens (default: %(default)s)",
    )
    shell.add_argument(
        "--repetition-penalty",
        type=float,
        default=SHELL_REPETITION_PENALTY,
        metavar="X",
        help="divides the logit of each token the conversation has used (Ollama's "
        "repeat_penalty; 1: off; default: %(default)s)",
    )
    shell.add_argument(
        "--frequency-penalty",
        type=float,
        default=SHELL_FREQUENCY_PENALTY,
        metavar="X",
        help="lowers a token's logit by X per time the reply has used it (0: off; default: "
        "%(default)s)",
    )
    shell.add_argument("--temperature", type=float, metavar="X", help="(default: the model's)")
    shell.add_argument("--top-p", type=float, metavar="X", help="(default: the model's)")
    dp = parser.add_argument_group("data parallelism (docs/scaling.md)")
    dp.add_argument(
        "--dp",
        "--dp-size",
        dest="dp_size",
        type=int,
        default=1,
        help="replicas on ports --port+1 .. --port+N, the SGLang Model Gateway on --port",
    )
    dp.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default=DEFAULT_ROUTER_POLICY,
        help="(default: %(default)s)",
    )
    dp.add_argument(
        "--router-args",
        default="",
        help='more gateway flags, e.g. "--health-check-interval-secs 2" (see smg launch --help)',
    )
    dp.add_argument(
        "--no-router", action="store_true", help="start the replicas only (a gateway elsewhere)"
    )
    return parser


def parse_server_args(argv: list[str] | None = None) -> tuple[ServerArgs, argparse.Namespace]:
    parser = build_arg_parser()
    ns = parser.parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(ServerArgs)}
    router_flags = ns.no_router or ns.router_args or ns.router_policy != DEFAULT_ROUTER_POLICY
    if ns.dp_size < 1:
        parser.error("--dp: must be >= 1")
    if ns.dp_size == 1 and router_flags:
        parser.error("--router-policy, --router-args and --no-router need --dp N with N > 1")
    if ns.dp_size > 1 and ns.shell:
        parser.error("--shell chats with one server: it does not take --dp")
    if ns.dp_size > 1 and (ns.nnodes > 1 or ns.dist_init_addr or ns.device.startswith("cuda:")):
        parser.error(
            "--dp places its replicas on this machine, each with its own tp group and GPUs: it "
            "takes no --nnodes, --dist-init-addr or --device cuda:N (pick GPUs by "
            "CUDA_VISIBLE_DEVICES; several machines: docs/scaling.md)"
        )
    ns.shell_sampling = {k: v for k in SHELL_SAMPLING if (v := getattr(ns, k)) is not None}
    try:
        SamplingParams(**ns.shell_sampling)
        args = ServerArgs(**values)
    except ValueError as exc:  # "page_size: must be >= 1" -> "--page-size: must be >= 1"
        name, _, rule = str(exc).partition(": ")
        flag = "shell-max-tokens" if name == "max_tokens" else name.replace("_", "-")
        parser.error(f"--{flag}: {rule}")
    if args.device.startswith("cuda") and (reason := _no_cuda_reason()):
        parser.error(f"--device {args.device}: {reason}")
    return args, ns


def _no_cuda_reason() -> str | None:
    """Why CUDA cannot run here, or None. A CPU-only build of torch is told from its files:
    importing torch takes seconds."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "torch is not installed"
    lib = Path(spec.origin).parent / "lib"
    if not any(any(lib.glob(f"libtorch_{gpu}*")) for gpu in ("cuda", "hip")):
        return (
            f"torch {importlib.metadata.version('torch')} is a CPU-only build: install a CUDA "
            "build of torch (README.md, Quick start)"
        )
    import torch

    if not torch.cuda.is_available():
        return "torch finds no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
    return None


def data_parallel_args(ns: argparse.Namespace) -> DataParallelArgs:
    return DataParallelArgs(
        dp_size=ns.dp_size,
        router_policy=ns.router_policy,
        router_args=tuple(shlex.split(ns.router_args)),
        use_router=not ns.no_router,
    )


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C (or chat, with --shell); returns the process exit code."""
    args, namespace = parse_server_args(argv)
    if namespace.shell:
        from minisgl.shell import run_shell

        return run_shell(args, namespace)
    dp = data_parallel_args(namespace)
    # A busy port is an error in the first second, not after the model has loaded.
    for port in range(args.port, args.port + dp.dp_size + (dp.dp_size > 1)):
        try:
            with socket.create_server((args.host, port)):
                pass
        except OSError as exc:
            where = f"{args.host}:{port}: {exc.strerror or exc}"
            sys.exit(f"python -m minisgl.server: error: cannot listen on {where}")
    from minisgl.runtime.launch import ServerStack, run_until_stopped

    if dp.dp_size > 1:
        from minisgl.runtime.dp import DataParallelStack

        return run_until_stopped(DataParallelStack(args, dp))
    return run_until_stopped(ServerStack(args))


if __name__ == "__main__":
    sys.exit(main())
