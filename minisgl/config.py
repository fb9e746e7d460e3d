"""One frozen configuration for the offline API and the server.

`LLM(model=..., page_size=16)` and `python -m minisgl.server --page-size 16` build the same
`ServerArgs`: every field is a CLI flag with dashes and an `LLM` keyword with underscores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from minisgl.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)
from minisgl.pooling import POOLING_MODES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919
# On CPU the KV pool takes this share of the memory available at start (split between the node's
# ranks): its pages are committed only as they are first written, so an idle pool costs nothing.
CPU_KV_MEMORY_FRACTION = 0.25
DISABLE_OVERLAP_ENV = "MINISGL_DISABLE_OVERLAP_SCHEDULING"
DEFAULT_CUDA_MAX_PREFILL_TOKENS = 8192
DEFAULT_CPU_MAX_PREFILL_TOKENS = 1024
# --target-itl-ms's default: this many decode steps plus this much more per step with prefill
AUTO_ITL_DECODE_STEPS = 2.0
AUTO_ITL_EXTRA_MS = 100.0


def env_switch(name: str) -> bool | None:
    """An on/off environment variable: False for 0/false/off/no, True for 1/true/on/yes, None
    when unset or anything else (auto)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    return True if value in ("1", "true", "on", "yes") else None


# Data parallelism (minisgl/runtime/dp.py): the SGLang Model Gateway's routing policies.
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DEFAULT_ROUTER_POLICY = "cache_aware"

# One home for each option's allowed values: ServerArgs checks them, the CLI offers them.
CHOICES: dict[str, tuple[str, ...]] = {
    "cache_type": ("radix", "naive"),
    "overlap": ("auto", "on", "off"),
    "attention_backend": ("auto", "flashinfer", "triton", "torch"),
    "sampling_defaults": ("model", "openai"),
    # The chat parsers (minisgl.chat); auto picks from the chat template.
    "reasoning_parser": ("qwen3", "deepseek-r1", "auto"),
    "tool_call_parser": ("hermes", "qwen25", "llama3_json", "auto"),
    "speculative_algorithm": ("ngram",),
    "schedule_policy": ("fcfs", "lpm"),
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "quantization": ("auto", "gguf", "none"),
    "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16", "fp16", "float16"),
    "log_level": ("debug", "info", "warning", "error"),
    "pooling": POOLING_MODES,
}
_OPTIONAL_CHOICES = (
    "reasoning_parser",
    "tool_call_parser",
    "speculative_algorithm",
    "pooling",
)  # None: off
# Serving any request takes a one-token prompt and its first output token, and a pool of one
# page may hold only the prompt: a smaller pool or context is refused at start.
MIN_KV_PAGES = 2
MIN_MODEL_LEN = 2
MAX_PORT = (1 << 16) - 1
# Each numeric option's lowest value (the options in _ABOVE_LOW must exceed it) and, for two,
# its highest. Every value must be finite.
_LOWER_BOUNDS = {
    "max_model_len": MIN_MODEL_LEN,
    "page_size": 1,
    "num_pages": MIN_KV_PAGES,
    "kv_cache_gb": 0,
    "max_running_requests": 1,
    "max_prefill_tokens": 1,
    "target_itl_ms": 0,
    "priority_aging_s": 0,
    "speculative_num_draft_tokens": 1,
    "speculative_ngram_min_match": 1,
    "speculative_ngram_max_match": 1,
    "port": 1,
    "max_sequences_per_request": 1,
    "max_queued_requests": 0,
    "request_timeout_s": 0,
    "max_request_body_bytes": 1,
    "grammar_compile_timeout_s": 0,
    "shutdown_timeout_s": 0,
    "tp_size": 1,
    "nnodes": 1,
    "node_rank": 0,
    "mem_fraction_static": 0,
    "cuda_graph_max_bs": 0,
}
_UPPER_BOUNDS = {"port": MAX_PORT, "mem_fraction_static": 1}
_ABOVE_LOW = (
    "kv_cache_gb",
    "request_timeout_s",
    "grammar_compile_timeout_s",
    "mem_fraction_static",
)


def _range(name: str) -> str:
    """The range option `name` must be in: ">= 1", "in (0, 1]"."""
    low, high = _LOWER_BOUNDS[name], _UPPER_BOUNDS.get(name)
    above = name in _ABOVE_LOW
    if high is None:
        return f"{'>' if above else '>='} {low}"
    return f"in {'(' if above else '['}{low}, {high}]"


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
    served_model_name: str | None = _opt(
        None, MODEL, "the name clients send (default: --model; a GGUF file: its file name)"
    )
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
    # /v1/embeddings (minisgl.pooling): every model embeds, generative ones too
    pooling: str | None = _opt(
        None,
        MODEL,
        "embeddings: mean, last or cls (default: the sentence-transformers config's, else mean)",
    )
    page_size: int = _opt(1, MEMORY, "tokens per KV cache page")
    num_pages: int | None = _opt(None, MEMORY, "KV pool size in pages (overrides the budgets)")
    kv_cache_gb: float | None = _opt(
        None, MEMORY, "KV pool budget in GiB (default on CPU: a quarter of the available memory)"
    )
    cache_type: str = _opt("radix", MEMORY, "radix reuses cached prefixes; naive does not")
    kv_cache_dtype: str = _opt(
        "auto", MEMORY, "the KV pool's: fp8_e4m3, fp8_e5m2 (4x fp32's tokens), bf16, fp16 (2x)"
    )
    max_running_requests: int = _opt(256, SCHED, "sequences decoded together, at most")
    # Chunked prefill. CPU's default is lower: a chunk of 8192 tokens takes seconds there and
    # stalls every running decode meanwhile.
    max_prefill_tokens: int | None = _opt(
        None, SCHED, "prompt tokens prefilled per step (default: 8192 on CUDA, 1024 on CPU)"
    )
    # While streams decode, a step's prefill chunks are sized from the measured cost of a step
    # so that it takes about this long (minisgl/scheduler/step_cost.py).
    target_itl_ms: float | None = _opt(
        None,
        SCHED,
        "decoding streams' inter-token latency to keep while prompts prefill, in ms "
        f"(default: {AUTO_ITL_DECODE_STEPS:g} decode steps + {AUTO_ITL_EXTRA_MS:g} ms; 0: off, "
        "chunks of --max-prefill-tokens only)",
    )
    # Overlap scheduling: auto is on for CUDA (the host work hides behind the GPU), off for CPU
    # (the forward already uses every core, so the scheduling thread only competes with it:
    # 3-15% slower in benchmark/RESULTS.md).
    overlap: str = _opt(
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
            if (value := getattr(self, name)) is not None:
                above_low = value > low if name in _ABOVE_LOW else value >= low
                high = _UPPER_BOUNDS.get(name, math.inf)
                fits = above_low and value <= high and value < math.inf  # NaN fails each
                finite = "" if value < math.inf else "a finite number "
                check(fits, name, f"must be {finite}{_range(name)} (got {value})")
        device_ok = re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None
        check(device_ok, "device", "must be auto, cpu, cuda or cuda:N")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            allowed = value in choices or (value is None and name in _OPTIONAL_CHOICES)
            check(allowed, name, f"must be one of {', '.join(choices)}")
        check(self.node_rank < self.nnodes, "node_rank", f"must be < --nnodes ({self.nnodes})")
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
        off = self.disable_overlap or env_switch(DISABLE_OVERLAP_ENV) or self.overlap == "off"
        if off or self.speculative_algorithm is not None:
            return False
        return self.overlap == "on" or device_type == "cuda"

    def resolved_max_prefill_tokens(self, device_type: str) -> int:
        # `or`: the flag is None (unset) or at least 1
        return self.max_prefill_tokens or (
            DEFAULT_CUDA_MAX_PREFILL_TOKENS
            if device_type == "cuda"
            else DEFAULT_CPU_MAX_PREFILL_TOKENS
        )

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
    a server one: every replica is a plain server with its own ServerArgs). The command line
    checks the values (minisgl/server.py)."""

    dp_size: int = 1
    router_policy: str = DEFAULT_ROUTER_POLICY
    router_args: tuple[str, ...] = ()  # extra gateway flags; they override ours
    use_router: bool = True  # False: the replicas alone, for a gateway that runs elsewhere
