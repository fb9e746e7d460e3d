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
from dataclasses import dataclass, fields
from typing import Any, Literal

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919
# On CPU there is no "free device memory" to take a fraction of: give the KV pool a fixed budget.
DEFAULT_CPU_KV_CACHE_GB = 1.0
DISABLE_OVERLAP_ENV = "MINISGL_DISABLE_OVERLAP_SCHEDULING"
DEFAULT_CUDA_MAX_PREFILL_TOKENS = 8192
DEFAULT_CPU_MAX_PREFILL_TOKENS = 1024
MIB = 1 << 20

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
}
_OPTIONAL_CHOICES = ("reasoning_parser", "tool_call_parser", "speculative_algorithm")  # None: off
_LOWER_BOUNDS = {
    "page_size": 1,
    "num_pages": 1,
    "tp_size": 1,
    "max_running_requests": 1,
    "max_prefill_tokens": 1,
    "cuda_graph_max_bs": 0,
    "max_sequences_per_request": 1,
    "max_queued_requests": 0,
    "max_request_body_bytes": 1,
    "shutdown_timeout_s": 0,
    "speculative_num_draft_tokens": 1,
    "speculative_ngram_min_match": 1,
}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None  # local HF folder or hub id; None serves the bundled default model
    served_model_name: str | None = None  # the name clients send; defaults to --model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    tp_size: int = 1
    # KV cache
    page_size: int = 1
    num_pages: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_gb: float | None = None  # explicit pool budget in GiB
    mem_fraction_static: float = 0.85  # CUDA: fraction of device memory for weights + KV
    cache_type: CacheType = "radix"
    # scheduling
    max_running_requests: int = 256
    # Token budget of one batch's prefill work (chunked prefill). None: 8192 on CUDA, 1024 on CPU,
    # where a chunk of 8192 tokens takes seconds and stalls every running decode meanwhile.
    max_prefill_tokens: int | None = None
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Overlap scheduling: schedule batch N+1 while batch N computes. auto: on for CUDA (the host
    # work hides behind the GPU), off for CPU (the forward already uses every core, so the
    # scheduling thread only competes with it: 3-15% slower in benchmark/RESULTS.md).
    overlap: OverlapMode = "auto"
    disable_overlap: bool = False  # the same as --overlap off (as does MINISGL_DISABLE_...=1)
    # auto: flashinfer on CUDA when installed, else triton on CUDA when installed, else torch
    attention_backend: str = "auto"
    # Decode batches up to this size replay CUDA graphs (padded to captured sizes); 0 disables.
    # None: 256 on CUDA (capped by max_running_requests), 0 on CPU. On CPU a positive value runs
    # the same padded path eagerly (used to test the padding).
    cuda_graph_max_bs: int | None = None
    seed: int = 0
    # Speculative decoding (docs/speculative.md): ngram drafts the next tokens from the request's
    # own prompt and output, verified in one forward; None: off.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4  # drafts verified per step, at most
    speculative_ngram_min_match: int = 2  # the lengths of suffix looked up, the longest first
    speculative_ngram_max_match: int = 4
    # server
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    log_level: str = "info"
    # hub downloads (when --model is a hub id; see minisgl/models/resolve.py)
    revision: str | None = None  # branch, tag or commit; default: the repo's default branch
    download_dir: str | None = None  # cache folder to download into; default: HF_HUB_CACHE
    offline: bool = False  # the local cache only, never the hub (like HF_HUB_OFFLINE=1)
    # Limits on what one client can ask of the server (docs/server.md, "Limits").
    max_sequences_per_request: int = 256  # prompts x n of one request; over it: 400
    # Sequences that may wait beyond --max-running-requests; over it: 503 with Retry-After.
    max_queued_requests: int = 1024
    request_timeout_s: float | None = None  # abort a request running longer (504); None: never
    max_request_body_bytes: int = 32 * MIB  # over it: 413
    # SIGTERM: stop taking requests (503) and let open ones finish for this long, then abort.
    shutdown_timeout_s: float = 20.0
    # chat (docs/server.md, "Reasoning, tools and structured outputs")
    chat_template: str | None = None  # a Jinja file replacing the checkpoint's chat template
    # Template variables for every chat request (a JSON object, e.g. '{"enable_thinking":
    # false}'); a request's chat_template_kwargs override them. LLM(...) also takes a dict.
    chat_template_kwargs: str | None = None
    reasoning_parser: str | None = None  # qwen3, deepseek-r1 or auto: split off <think> text
    tool_call_parser: str | None = None  # hermes, qwen25, llama3_json or auto: parse tool calls
    # model: a request's unset temperature / top_p / top_k / min_p / repetition_penalty come from
    # the checkpoint's generation_config.json (SGLang's and vLLM's default); openai: the OpenAI
    # API's defaults (temperature 1, no top-k / top-p / min-p, no penalty).
    sampling_defaults: str = "model"
    # multi-node tensor parallelism
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

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
        check(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype", "unknown dtype")
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
        check(
            self.request_timeout_s is None or self.request_timeout_s > 0,
            "request_timeout_s",
            "must be > 0",
        )
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
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
    "shutdown_timeout_s": ["--shutdown-timeout"],
    # SGLang's longer names
    "speculative_ngram_min_match": ["--speculative-ngram-min-match-window-size"],
    "speculative_ngram_max_match": ["--speculative-ngram-max-match-window-size"],
}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minisgl.server", description=__doc__)
    for f in fields(ServerArgs):
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        default = f.default
        if f.type in ("bool",) or isinstance(default, bool):
            parser.add_argument(*flags, dest=f.name, action="store_true", default=default)
            continue
        kind: Any = str
        type_name = str(f.type)
        if "int" in type_name:
            kind = int
        elif "float" in type_name:
            kind = float
        kwargs: dict[str, Any] = {"dest": f.name, "type": kind, "default": default}
        if f.name in CHOICES:
            kwargs["choices"] = list(CHOICES[f.name])
        parser.add_argument(*flags, **kwargs)
    parser.add_argument("--shell", action="store_true", help="chat in this terminal")
    dp = parser.add_argument_group("data parallelism (docs/scaling.md)")
    dp.add_argument(
        "--dp",
        "--dp-size",
        dest="dp_size",
        type=int,
        default=1,
        help="replicas on ports --port+1 .. --port+N, the SGLang Model Gateway on --port",
    )
    dp.add_argument("--router-policy", choices=ROUTER_POLICIES, default=DEFAULT_ROUTER_POLICY)
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
    return ServerArgs(**values), ns


def data_parallel_args(ns: argparse.Namespace) -> DataParallelArgs:
    return DataParallelArgs(
        dp_size=ns.dp_size,
        router_policy=ns.router_policy,
        router_args=tuple(shlex.split(ns.router_args)),
        use_router=not ns.no_router,
    )
