"""One frozen configuration for the offline API and the server.

`LLM(model=..., page_size=16)` and `python -m minisgl.server --page-size 16` build the same
`ServerArgs`: every field is a CLI flag with dashes and an `LLM` keyword with underscores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NoReturn

from minisgl.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919
# On CPU there is no "free device memory" to take a fraction of: give the KV pool a fixed budget.
DEFAULT_CPU_KV_CACHE_GB = 1.0
DISABLE_OVERLAP_ENV = "MINISGL_DISABLE_OVERLAP_SCHEDULING"
DEFAULT_CUDA_MAX_PREFILL_TOKENS = 8192
DEFAULT_CPU_MAX_PREFILL_TOKENS = 1024

# Data parallelism (minisgl/runtime/dp.py): the SGLang Model Gateway's routing policies.
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DEFAULT_ROUTER_POLICY = "cache_aware"

CacheType = Literal["radix", "naive"]
OverlapMode = Literal["auto", "on", "off"]
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch")
# The chat parsers (minisgl.chat); auto picks from the chat template.
REASONING_PARSER_CHOICES = ("qwen3", "deepseek-r1", "auto")
TOOL_CALL_PARSER_CHOICES = ("hermes", "qwen25", "llama3_json", "auto")
SAMPLING_DEFAULTS_CHOICES = ("model", "openai")


# One home for each option's allowed values: ServerArgs checks them, the CLI offers them.
CHOICES: dict[str, tuple[str, ...]] = {
    "cache_type": ("radix", "naive"),
    "overlap": ("auto", "on", "off"),
    "attention_backend": ATTENTION_BACKENDS,
    "sampling_defaults": SAMPLING_DEFAULTS_CHOICES,
    "reasoning_parser": REASONING_PARSER_CHOICES,
    "tool_call_parser": TOOL_CALL_PARSER_CHOICES,
    "speculative_algorithm": ("ngram",),
    "schedule_policy": ("fcfs", "lpm"),
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "quantization": ("auto", "gguf", "none"),
    "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
    "log_level": ("debug", "info", "warning", "error"),
}
_OPTIONAL_CHOICES = ("reasoning_parser", "tool_call_parser", "speculative_algorithm")  # None: off
_LOWER_BOUNDS = {
    "page_size": 1, "num_pages": 1, "tp_size": 1, "max_running_requests": 1,
    "max_prefill_tokens": 1, "cuda_graph_max_bs": 0, "max_sequences_per_request": 1,
    "max_queued_requests": 0, "max_request_body_bytes": 1, "shutdown_timeout_s": 0,
    "priority_aging_s": 0, "speculative_num_draft_tokens": 1, "speculative_ngram_min_match": 1,
    "port": 1,
}  # fmt: skip


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# The --help groups (listed in the order the fields first name them).
MODEL, MEMORY, SCHED, GPU = "model", "memory (KV cache)", "scheduling", "GPU"
SPEC = "speculative decoding (docs/speculative.md)"
API, CHAT = "API server (docs/server.md)", "chat: templates, parsers, sampling defaults"
PARALLEL = "parallelism (docs/tensor_parallel.md)"


def _opt(default: Any, group: str, help: str) -> Any:
    """A ServerArgs field with its --help group and line: one home for each flag."""
    return field(default=default, metadata={"group": group, "help": help})


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = _opt(
        None, MODEL, "HF checkpoint folder, GGUF file or hub id (default: the bundled SmolLM2)"
    )
    served_model_name: str | None = _opt(None, MODEL, "the name clients send (default: --model)")
    tokenizer: str | None = _opt(None, MODEL, "tokenizer folder or hub id (default: the model's)")
    dtype: str = _opt("auto", MODEL, "auto: float32 on CPU, bfloat16 on CUDA")
    quantization: str = _opt(
        "auto", MODEL, "auto: GGUF blocks on CPU, FP8 on FP8 GPUs; none: dequantize"
    )
    device: str = _opt("auto", MODEL, "cpu, cuda or cuda:N; auto: cuda when there is one")
    max_model_len: int | None = _opt(None, MODEL, "longest prompt + output (default: the model's)")
    revision: str | None = _opt(None, MODEL, "hub download: branch, tag or commit")
    download_dir: str | None = _opt(None, MODEL, "hub download: cache folder (default: HF's)")
    offline: bool = _opt(False, MODEL, "never download: the local cache only (HF_HUB_OFFLINE=1)")
    page_size: int = _opt(1, MEMORY, "tokens per KV cache page")
    num_pages: int | None = _opt(None, MEMORY, "KV pool size in pages (overrides the budgets)")
    kv_cache_gb: float | None = _opt(
        None, MEMORY, f"KV pool budget in GiB (default: {DEFAULT_CPU_KV_CACHE_GB} on CPU)"
    )
    cache_type: CacheType = _opt("radix", MEMORY, "radix reuses cached prefixes; naive does not")
    kv_cache_dtype: str = _opt("auto", MEMORY, "fp8_e4m3 or fp8_e5m2: an fp8 KV pool (4x fp32's)")
    max_running_requests: int = _opt(256, SCHED, "sequences decoded together, at most")
    # Chunked prefill. CPU's default is lower: a chunk of 8192 tokens takes seconds there and
    # stalls every running decode meanwhile.
    max_prefill_tokens: int | None = _opt(
        None, SCHED, "prompt tokens prefilled per step (default: 8192 on CUDA, 1024 on CPU)"
    )
    # Overlap scheduling: auto is on for CUDA (the host work hides behind the GPU), off for CPU
    # (the forward already uses every core, so the scheduling thread only competes with it:
    # 3-15% slower in benchmark/RESULTS.md).
    overlap: OverlapMode = _opt(
        "auto", SCHED, "plan step N+1 while N computes; auto: on for CUDA, off for CPU"
    )
    disable_overlap: bool = _opt(False, SCHED, f"--overlap off (so is {DISABLE_OVERLAP_ENV}=1)")
    seed: int = _opt(0, SCHED, "random seed of the requests that give no seed")
    # Who goes first (minisgl/scheduler/policy.py, docs/server.md "Scheduling policies").
    schedule_policy: str = _opt("fcfs", SCHED, "fcfs: arrival order; lpm: longest cached prefix")
    enable_priority_scheduling: bool = _opt(False, SCHED, "queue by request `priority`, preempting")
    schedule_low_priority_values_first: bool = _opt(False, SCHED, "smaller `priority` values first")
    priority_aging_s: float = _opt(60.0, SCHED, "+1 priority level per this many s waited; 0: off")
    tenant_fairness: bool = _opt(False, SCHED, "fair shares per tenant (`user`, else API key)")
    speculative_algorithm: str | None = _opt(
        None, SPEC, "ngram: draft from the request's own text, verify in one forward (off)"
    )
    speculative_num_draft_tokens: int = _opt(4, SPEC, "drafts verified per step, at most")
    speculative_ngram_min_match: int = _opt(2, SPEC, "shortest suffix looked up, in tokens")
    speculative_ngram_max_match: int = _opt(4, SPEC, "longest suffix looked up (tried first)")
    host: str = _opt(DEFAULT_HOST, API, "address to listen on (0.0.0.0: every interface)")
    port: int = _opt(DEFAULT_PORT, API, "port to listen on")
    api_key: str | None = _opt(None, API, "clients must send it as a Bearer token (off)")
    log_level: str = _opt("info", API, "debug, info, warning or error")
    max_sequences_per_request: int = _opt(
        DEFAULT_MAX_SEQUENCES_PER_REQUEST, API, "prompts x n in one request; over it: 400"
    )
    max_queued_requests: int = _opt(
        DEFAULT_MAX_QUEUED_REQUESTS,
        API,
        "sequences waiting beyond --max-running-requests; over it: 503",
    )
    request_timeout_s: float | None = _opt(None, API, "abort requests running longer: 504 (off)")
    max_request_body_bytes: int = _opt(
        DEFAULT_MAX_REQUEST_BODY_BYTES, API, "larger request bodies: 413"
    )
    grammar_compile_timeout_s: float = _opt(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        API,
        "a request's JSON schema / regex / grammar compiling longer: 400",
    )
    shutdown_timeout_s: float = _opt(
        DEFAULT_SHUTDOWN_TIMEOUT_S, API, "SIGTERM: seconds open requests may finish"
    )
    chat_template: str | None = _opt(None, CHAT, "a Jinja file replacing the model's template")
    chat_template_kwargs: str | None = _opt(
        None,
        CHAT,
        "template variables for every request (JSON, e.g. '{\"enable_thinking\": false}')",
    )
    reasoning_parser: str | None = _opt(
        None, CHAT, "split <think> text off as reasoning_content; auto: from the template (off)"
    )
    tool_call_parser: str | None = _opt(
        "auto", CHAT, "how replies write tool calls; auto: from the template, else <tool_call>"
    )
    # model: SGLang's and vLLM's default; openai: temperature 1, no top-k/top-p/min-p/penalty.
    sampling_defaults: str = _opt(
        "model", CHAT, "unset sampling fields: from generation_config.json, or OpenAI's"
    )
    tp_size: int = _opt(1, PARALLEL, "tensor-parallel ranks (GPUs; processes on CPU)")
    nnodes: int = _opt(1, PARALLEL, "nodes of one tensor-parallel group")
    node_rank: int = _opt(0, PARALLEL, "this node's rank (0 serves the API)")
    dist_init_addr: str | None = _opt(None, PARALLEL, "host:port of node 0, for --nnodes > 1")
    mem_fraction_static: float = _opt(0.85, GPU, "device memory for weights + KV pool")
    attention_backend: str = _opt("auto", GPU, "auto: flashinfer, else triton (CUDA); torch")
    cuda_graph_max_bs: int | None = _opt(None, GPU, "largest CUDA-graph batch; 0: off (CUDA: 256)")

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}")

        for name, low in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            check(value is None or value >= low, name, f"must be >= {low}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            allowed = value in choices or (value is None and name in _OPTIONAL_CHOICES)
            check(allowed, name, f"must be one of {', '.join(choices)}")
        check(self.port < 1 << 16, "port", "must be < 65536")
        check(0 < self.mem_fraction_static < 1, "mem_fraction_static", "must be in (0, 1)")
        check(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes, "node_rank", "out of range")
        check(
            self.speculative_ngram_max_match >= self.speculative_ngram_min_match,
            "speculative_ngram_max_match",
            "must be >= speculative_ngram_min_match",
        )
        # A verify step's next positions depend on how many drafts it accepted: nothing can be
        # scheduled before its results are in.
        check(
            self.speculative_algorithm is None or self.overlap != "on",
            "overlap",
            "speculative decoding runs without overlap scheduling",
        )
        timeout_s = self.request_timeout_s
        check(timeout_s is None or timeout_s > 0, "request_timeout_s", "must be > 0")
        check(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s", "must be > 0")
        kwargs: Any = self.chat_template_kwargs
        if isinstance(kwargs, dict):  # LLM(chat_template_kwargs={...}): kept as JSON text
            object.__setattr__(self, "chat_template_kwargs", json.dumps(kwargs))
        elif kwargs is not None:
            try:
                parsed = json.loads(kwargs)
            except ValueError:
                parsed = None
            check(isinstance(parsed, dict), "chat_template_kwargs", "must be a JSON object")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def overlap_enabled(self, device_type: str) -> bool:
        off = self.disable_overlap or _env_flag(DISABLE_OVERLAP_ENV) or self.overlap == "off"
        if off or self.speculative_algorithm is not None:
            return False
        return self.overlap == "on" or device_type == "cuda"

    def resolved_max_prefill_tokens(self, device_type: str) -> int:
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        if device_type == "cuda":
            return DEFAULT_CUDA_MAX_PREFILL_TOKENS
        return DEFAULT_CPU_MAX_PREFILL_TOKENS

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        if unknown := sorted(set(kwargs) - {f.name for f in fields(cls)}):
            raise TypeError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class DataParallelArgs:
    """`--dp N`: N replicas of the server behind the SGLang Model Gateway (a launcher option, not
    a server one: every replica is a plain server with its own ServerArgs)."""

    dp_size: int = 1
    router_policy: str = DEFAULT_ROUTER_POLICY
    router_args: tuple[str, ...] = ()  # extra gateway flags; they override ours
    use_router: bool = True  # False: the replicas alone, for a gateway that runs elsewhere

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError("dp_size: must be >= 1")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy: must be one of {', '.join(ROUTER_POLICIES)}")


# Aliases users of Mini-SGLang / SGLang / vLLM type.
_ALIASES: dict[str, list[str]] = {
    "model": ["--model-path"],
    "tp_size": ["--tp"],
    "cache_type": ["--cache"],
    "max_model_len": ["--context-length"],
    "max_running_requests": ["--max-num-seqs"],
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
SHELL_MAX_TOKENS = 2048  # Mini-SGLang's shell bound: a reply never runs to the context limit


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag and the rule, not the whole usage."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _help(f: dataclasses.Field) -> str:
    shown = f.default is not None and not isinstance(f.default, bool)
    return f.metadata["help"] + (" (default: %(default)s)" if shown else "")


def build_arg_parser() -> argparse.ArgumentParser:
    usage = "%(prog)s [options]"
    parser = _Parser(prog="python -m minisgl.server", usage=usage, description=DESCRIPTION)
    groups: dict[str, Any] = {}  # in the order ServerArgs' fields first name them
    for f in fields(ServerArgs):
        if (name := f.metadata["group"]) not in groups:
            groups[name] = parser.add_argument_group(name)
        group = groups[name]
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": _help(f)}
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
    shell = parser.add_argument_group("shell")
    shell.add_argument("--shell", action="store_true", help="chat in this terminal (/exit quits)")
    shell.add_argument(
        "--shell-max-tokens",
        type=int,
        default=SHELL_MAX_TOKENS,
        help="longest reply in tokens (default: %(default)s)",
    )
    shell.add_argument("--temperature", type=float, help="(default: the model's)")
    shell.add_argument("--top-p", type=float, help="(default: the model's)")
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
        parser.error("--dp places its replicas on this machine, each with its own tp group and "
                     "GPUs: it takes no --nnodes, --dist-init-addr or --device cuda:N (pick GPUs "
                     "by CUDA_VISIBLE_DEVICES; several machines: docs/scaling.md)")  # fmt: skip
    if ns.shell_max_tokens < 1:
        parser.error("--shell-max-tokens: must be >= 1")
    try:
        return ServerArgs(**values), ns
    except ValueError as exc:  # "page_size: must be >= 1" -> "--page-size: must be >= 1"
        name, _, rule = str(exc).partition(": ")
        parser.error(f"--{name.replace('_', '-')}: {rule}")


def check_address(host: str, port: int, num_ports: int = 1) -> None:
    """Before anything loads: a busy port is an error in the first second, not after the model
    has loaded. Raises OSError naming the address."""
    for p in range(port, port + num_ports):
        try:
            with socket.create_server((host, p)):
                pass
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{p}: {exc.strerror or exc}") from None


def data_parallel_args(ns: argparse.Namespace) -> DataParallelArgs:
    return DataParallelArgs(
        dp_size=ns.dp_size,
        router_policy=ns.router_policy,
        router_args=tuple(shlex.split(ns.router_args)),
        use_router=not ns.no_router,
    )
