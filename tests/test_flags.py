"""Every flag is checked before anything loads (issue 42): a bad value is one line naming the
flag and its allowed range, exit code 2, in the first seconds; a KV pool that cannot serve any
request is refused at start with the numbers; the model ids users expect."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import CHOICES, MIN_KV_PAGES, ServerArgs
from minisgl.kvcache.pool import KV_CACHE_DTYPES
from minisgl.models.names import accepted_model_names, served_model_name
from minisgl.server import build_arg_parser, parse_server_args

ERROR_PREFIX = "python -m minisgl.server: error: "
EXEMPT_FLAGS = {"--seed"}  # any integer seeds the generator of the requests' seeds
BELOW_EVERY_RANGE = "-1000"
# Flags with an upper end, and a value past it.
ABOVE_RANGE = {
    "--port": "65536",
    "--mem-fraction-static": "1.5",
    "--top-p": "1.5",
    "--frequency-penalty": "3",
    "--repetition-penalty": "inf",
}


def _numeric_flags() -> list[tuple[str, type]]:
    return [
        (action.option_strings[0], action.type)
        for action in build_arg_parser()._actions
        if action.type in (int, float) and action.option_strings[0] not in EXEMPT_FLAGS
    ]


def _refusal(argv: list[str], capsys) -> str:
    """parse_server_args' one-line error for `argv` (it must exit with code 2)."""
    with pytest.raises(SystemExit) as exc:
        parse_server_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), lines
    return lines[0].removeprefix(ERROR_PREFIX)


def test_the_numeric_flags_are_all_found():
    flags = dict(_numeric_flags())
    assert {"--kv-cache-gb", "--num-pages", "--max-model-len", "--shell-max-tokens"} <= set(flags)
    assert len(flags) >= 25, sorted(flags)


@pytest.mark.parametrize(("flag", "kind"), _numeric_flags())
def test_every_numeric_flag_refuses_values_out_of_its_range(flag, kind, capsys):
    values = [BELOW_EVERY_RANGE, *(["nan"] if kind is float else []), ABOVE_RANGE.get(flag)]
    for value in filter(None, values):
        error = _refusal([f"{flag}={value}"], capsys)
        assert error.startswith(f"{flag}: must be"), (value, error)
        assert any(ch.isdigit() for ch in error.partition(": must be")[2]), error  # the range


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-gb", "-2"], "--kv-cache-gb: must be > 0"),
        (["--max-model-len", "0"], "--max-model-len: must be >= 2"),
        (["--num-pages", "1"], f"--num-pages: must be >= {MIN_KV_PAGES}"),
        (["--device", "tpu"], "--device: must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_the_issues_bad_flags_fail_in_the_first_seconds(flags, message):
    _assert_refused_quickly(flags, message)


def test_kv_cache_dtype_takes_vllm_and_sglang_names(capsys):
    """Each name the flag allows maps to a pool dtype (the two tables stay in step); others are
    refused with the allowed names."""
    assert set(CHOICES["kv_cache_dtype"]) == {"auto", *KV_CACHE_DTYPES}
    for name, dtype in [("bf16", torch.bfloat16), ("float16", torch.float16)]:
        args, _ = parse_server_args(["--kv-cache-dtype", name])
        assert KV_CACHE_DTYPES[args.kv_cache_dtype] == dtype
    error = _refusal(["--kv-cache-dtype", "int4"], capsys)
    assert "invalid choice: 'int4'" in error and "bfloat16" in error, error
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of .*bf16"):
        ServerArgs(kv_cache_dtype="int4")  # LLM(...)'s check


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_device_cuda_without_cuda_says_so():
    cpu_only = torch.version.cuda is None and torch.version.hip is None
    _assert_refused_quickly(
        ["--device", "cuda"], "CPU-only build" if cpu_only else "finds no CUDA device"
    )


def _assert_refused_quickly(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "minisgl.server", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX + flags[0]), lines
    # One line and nothing else: refused before any stage (loading, spawning) began.
    assert message in lines[0], lines


def test_the_smallest_pool_serves_and_a_smaller_budget_is_refused(tiny_qwen3):
    options = dict(dtype="float32", page_size=1, max_running_requests=1)
    with LLM(str(tiny_qwen3), num_pages=MIN_KV_PAGES, **options) as llm:
        (out,) = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=1))
        assert len(out.token_ids) == 1
    with pytest.raises(RuntimeError, match=r"holds 0 pages of 1 tokens \(\d+ bytes each\)"):
        LLM(str(tiny_qwen3), kv_cache_gb=1e-9, **options)


def test_the_default_cpu_pool_takes_a_quarter_of_free_memory(tiny_qwen3, monkeypatch, caplog):
    """Without a budget flag: a quarter of the available memory, said at start, and never more
    than every request slot at full length."""
    options = dict(dtype="float32", page_size=1, max_running_requests=2)
    free_bytes = 64 << 20
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=free_bytes))
    with caplog.at_level("INFO"), LLM(str(tiny_qwen3), max_model_len=1 << 20, **options) as llm:
        bytes_per_token = llm.scheduler.engine.kv_pool.buffer[:, :, 0].numel() * 4
        assert llm.scheduler.engine.num_pages == free_bytes // 4 // bytes_per_token
    assert "KV cache: 0.02 GiB of the 0.06 GiB available" in caplog.text
    with LLM(str(tiny_qwen3), max_model_len=100, **options) as llm:
        assert llm.scheduler.engine.num_pages == 2 * 100


def test_model_ids():
    assert served_model_name(ServerArgs()) == "SmolLM2-135M-Instruct"
    gguf = ServerArgs(model="/models/qwen/Qwen3-0.6B-Q8_0.gguf")
    assert served_model_name(gguf) == "Qwen3-0.6B-Q8_0.gguf"
    assert gguf.model in accepted_model_names(gguf)  # the path still works in requests
    assert served_model_name(ServerArgs(model="Qwen/Qwen3-8B")) == "Qwen/Qwen3-8B"
    named = ServerArgs(model="/models/x.gguf", served_model_name="qwen3")
    assert served_model_name(named) == "qwen3"
    args, _ = parse_server_args(["--served-model-name", "qwen3"])
    assert served_model_name(args) == "qwen3"
