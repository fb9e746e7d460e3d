"""A new user's first minutes: README's commands walked in the order written, in a fresh venv
(its install line run for real; the examples see only what README has told the user to install
so far), then `--help` and the one-line errors for bad flags and a busy port."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from minisgl.config import ServerArgs
from minisgl.server import build_arg_parser
from tests.server_utils import ServerProcess, free_port_block, require_default_model

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_PORT = "127.0.0.1:1919"  # the address README's examples use; each test serves elsewhere
STEP_TIMEOUT_S = 300.0
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PIP_INSTALL = re.compile(r"`(pip install [^`]+)`")
BLOCKED_ENV = "MINISGL_TEST_BLOCKED_MODULES"
# Makes the fresh venv refuse the modules named in $MINISGL_TEST_BLOCKED_MODULES: CI installed
# them (the test extra), a user following README has not.
BLOCKER = """\
import importlib.abc, os, sys

BLOCKED = frozenset(filter(None, os.environ.get("MINISGL_TEST_BLOCKED_MODULES", "").split(",")))


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed)", name=name)
        return None


if BLOCKED:
    sys.meta_path.insert(0, Blocked())
"""
TEST_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh"
# Blocks this file does not run, and where each is checked instead; a block README gains must be
# walked here or named here (matched by its first line).
CHECKED_ELSEWHERE = {
    TEST_COMMAND: ".ci/run runs it, in a new venv",
    "python -m minisgl.server  ": "tests/test_server.py, test_hub_download.py, test_moe.py",
    "pip install sglang-router": "tests/test_dp.py, tests/test_gateway.py",
    'pip install -e ".[bench]"': "tests/test_benchmarks.py, tests/test_offline_bench.py",
    "cd examples/monitoring": "tests/test_metrics.py (docker is not on CI)",
}


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    prose_before: str  # README's text between the previous block and this one


def readme_blocks() -> list[Block]:
    text, blocks, start = README.read_text(), [], 0
    for match in FENCE.finditer(text):
        blocks.append(Block(match.group(1), match.group(2), text[start : match.start()]))
        start = match.end()
    return blocks


def _closure(requirements: list[str]) -> set[str]:
    """The distributions that `requirements` pull in, transitively, as installed here."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(req.name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for extra_name in ["", *req.extras]:
            todo += [(Requirement(r), extra_name) for r in requires]
    return {name for name, _ in seen}


@functools.cache  # it reads every installed distribution's metadata (seconds): once per state
def blocked_modules(installed_by_readme: tuple[str, ...]) -> frozenset[str]:
    """Top-level modules of what CI installs for the tests and README's user does not have."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test_requirements = project["optional-dependencies"]["test"]
    test_extra = _closure(test_requirements)
    # What the machine had before the test extra came stays, with what it needs (transformers
    # imports botocore when present, which needs dateutil, which matplotlib also brings)...
    base = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    has = _closure(["minisgl", *installed_by_readme, *sorted(base - test_extra)])
    # ...but what the test extra names itself is hidden unless minisgl or README brings it, even
    # when something else on the machine needs it too (a base Python with litellm has openai).
    named = {canonicalize_name(Requirement(r).name) for r in test_requirements}
    extra_only = (test_extra - has) | (named - _closure(["minisgl", *installed_by_readme]))
    modules: set[str] = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        names = {canonicalize_name(d) for d in dists}
        if names & extra_only and not names & (has - extra_only) and not module.startswith("_"):
            modules.add(module)
    return frozenset(modules)


def pip_installed(command: str) -> list[str]:
    """The packages a shell command's `pip install`s name (not `-e .`, not flags)."""
    names = []
    for segment in command.split("&&") if "pip install" in command else []:
        words = shlex.split(segment, comments=True)
        if words[:2] == ["pip", "install"]:
            names += [w for w in words[2:] if not w.startswith("-") and w != "."]
    return names


@dataclass
class FreshVenv:
    """A new venv that sees this environment's packages behind its own (so README's install
    line runs for real and quickly: torch is there already), except the blocked ones."""

    root: Path
    installed: list[str]

    def env(self, block: bool = True) -> dict[str, str]:
        """`block=False` for pip itself, whose build step may need test-only build tools."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        path = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        blocked = ",".join(sorted(blocked_modules(tuple(self.installed)))) if block else ""
        return {**env, "PATH": path, "VIRTUAL_ENV": str(self.root), BLOCKED_ENV: blocked}

    def run(self, command: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=ROOT,
            env=self.env(block=not command.startswith("pip ")),
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
        assert result.returncode == 0, f"$ {command}\n{result.stdout}\n{result.stderr}"
        self.installed += pip_installed(command)
        return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> FreshVenv:
    require_default_model()  # converted once by the test setup; the venv reuses the cache
    root = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=STEP_TIMEOUT_S)
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run(
        [str(root / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "zz_outer_env.pth").write_text("\n".join(sorted(ours)) + "\n")
    (Path(purelib) / "readme_blocker.py").write_text(BLOCKER)
    (Path(purelib) / "readme_blocker.pth").write_text("import readme_blocker\n")
    return FreshVenv(root, [])


def _local(code: str, port: int) -> str:
    return code.replace(README_PORT, f"127.0.0.1:{port}")


def test_readme_walked_in_order(venv):
    blocks = readme_blocks()
    walked = []
    serve = blocks[0].code.strip()
    assert serve.endswith("python -m minisgl.server"), serve
    *install, start = serve.split(" && ")
    venv.run(" && ".join(install))
    python = venv.run("command -v python").stdout.strip()
    assert python == str(venv.root / "bin" / "python")  # README's `python` is the fresh venv's
    walked.append(blocks[0])

    port = free_port_block()
    log_path = venv.root.parent / "server.log"
    with log_path.open("wb") as log:  # README's command, on a free port instead of 1919
        proc = subprocess.Popen(
            [*start.split(), "--port", str(port)],
            cwd=ROOT,
            env={**venv.env(), "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(proc, port, log_path)
    try:
        server.wait_healthy()
        # No long silence at start-up: each stage is logged as it begins, then with its time.
        stages = ("finding the model files", "loading the weights", "planning the KV", "allocating")
        for stage in stages:
            done = re.escape(stage) + r"[^\n]*: done in \d+\.\d s"
            assert re.search(done, server.log()), server.log()[-3000:]
        for block in blocks[1:]:
            first = block.code.lstrip().splitlines()[0]
            if any(first.startswith(key) for key in CHECKED_ELSEWHERE):
                continue
            for command in PIP_INSTALL.findall(block.prose_before):
                venv.run(command)  # "(`pip install openai` first: ...)"
            if block.language == "bash":
                out = venv.run(_local(block.code, port)).stdout
                _check_curl_examples(out)
            else:
                assert block.language == "python", block
                out = venv.run(f"python - <<'EOF'\n{_local(block.code, port)}\nEOF").stdout
                assert out.strip(), block.code
            walked.append(block)
    finally:
        server.stop()
    # install + serve, curl, the OpenAI SDK, the offline API: a README that loses one fails here
    assert len(walked) == 4, [b.code.splitlines()[0] for b in walked]
    assert "openai" in venv.installed


def _check_curl_examples(out: str) -> None:
    """README's curl block: one chat completion (JSON), then a streamed completion (SSE)."""
    reply, end = json.JSONDecoder().raw_decode(out)
    assert reply["choices"][0]["message"]["content"], reply
    events = [line for line in out[end:].splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2, out
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]), out


def test_ci_runs_readmes_test_command_in_a_new_venv():
    """README's test command is .ci/run's, in a new venv each run: CI fails where a fresh
    machine would (not only where an old environment happens to work)."""
    assert any(block.code.strip() == TEST_COMMAND for block in readme_blocks())
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND.replace(".venv", "$venv") + ' "$@"' in ci_lines
    assert any(line.startswith('venv_root="$(mktemp -d)"') for line in ci_lines)


def test_the_blocker_hides_what_readme_has_not_installed(venv):
    """The walk is only as strict as the fresh venv: the SDK is not there until README's
    `pip install openai`, while the server's own dependencies are."""
    probe = "import fastapi, torch, transformers, minisgl; import openai"
    fresh = FreshVenv(venv.root, [])
    result = subprocess.run(
        ["python", "-c", probe], env=fresh.env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "No module named 'openai'" in result.stderr, result.stderr
    assert {"openai", "langchain_openai", "agents"} <= blocked_modules(())
    assert "openai" not in blocked_modules(("openai",))
    assert not {"torch", "fastapi", "transformers", "numpy"} & blocked_modules(())


def test_help_gives_every_flag_a_line_with_its_default():
    parser = build_arg_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings:
            assert action.help, f"{action.option_strings} has no help"
    for group in ("model", "memory", "scheduling", "API", "parallelism", "GPU"):
        assert re.search(rf"^{group}\b", text, re.M | re.I), f"no {group} group"
    assert f"(default: {ServerArgs().port})" in text
    assert re.search(r"--dtype \{[a-z0-9,]+\}", text), "--dtype lists no choices"


@pytest.mark.parametrize(
    ("flags", "rule"),
    [
        (["--page-size", "-1"], "--page-size: must be >= 1"),
        (["--dtype", "float8"], "--dtype: invalid choice: 'float8'"),
        (["--tp", "0"], "--tp"),
        (["--port", "99999"], "--port"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(flags, rule):
    result = subprocess.run(
        [sys.executable, "-m", "minisgl.server", *flags],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and rule in lines[0], result.stderr
    assert lines[0].startswith("python -m minisgl.server: error:"), lines


def test_a_busy_port_fails_before_the_model_loads():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "minisgl.server", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "loading" not in result.stderr.lower()
    with pytest.raises(httpx.ConnectError):  # nothing was left listening or half-started
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
