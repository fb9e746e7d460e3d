"""A README install (`pip install -e .`) has only the runtime dependencies, while CI also installs
the test extra: these tests make sure nothing in `minisgl/` silently relies on the latter."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import TEST_SERVER_FLAGS, require_default_model

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minisgl"
# Optional accelerator packages: imported lazily where they are used, so the package imports and
# runs on CPU without them. Either inside a function, or at the top of a kernel module that is
# itself only ever imported lazily (a Triton kernel file needs `triton` at module level).
OPTIONAL_LAZY_MODULES = frozenset({"flashinfer", "sgl_kernel", "triton", "xgrammar", "llguidance"})
SHELL_TIMEOUT_S = 240.0


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        _canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])
        for req in project["dependencies"]
    }


def _imports(path: Path, full_names: bool = False) -> list[tuple[str, int, bool]]:
    """(top-level module, line, inside a function) for every absolute import that runs at run
    time; `if TYPE_CHECKING:` blocks are skipped. `full_names` keeps dotted module names."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.orelse:
                visit(stmt, in_function)
            return

        def name(module: str) -> str:
            return module if full_names else module.split(".")[0]

        if isinstance(node, ast.Import):
            found.extend((name(a.name), node.lineno, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((name(node.module), node.lineno, in_function))
        is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or is_function)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _kernel_modules(files: list[Path]) -> set[str]:
    """Modules that import an optional package at module level."""
    return {
        _module_name(path)
        for path in files
        if any(m in OPTIONAL_LAZY_MODULES and not f for m, _, f in _imports(path))
    }


def test_every_runtime_import_is_a_declared_dependency():
    declared = _runtime_requirements()
    distributions = importlib.metadata.packages_distributions()
    problems = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    kernels = _kernel_modules(files)
    for path in files:
        where_file = path.relative_to(ROOT)
        if _module_name(path) not in kernels:
            for module, line, in_function in _imports(path, full_names=True):
                if module in kernels and not in_function:
                    problems.append(
                        f"{where_file}:{line} imports kernel module {module} at module level: "
                        "import it lazily (it needs an optional package)"
                    )
        for module, line, _ in _imports(path):
            where = f"{where_file}:{line} imports {module}"
            if module in ("minisgl", "__future__") or module in sys.stdlib_module_names:
                continue
            if module in OPTIONAL_LAZY_MODULES:
                continue  # inside a function, or in a kernel module only imported lazily
            dists = {_canonical(d) for d in distributions.get(module, [])}
            if not dists:
                problems.append(f"{where}, which is not installed here at all")
            elif not dists & declared:
                problems.append(f"{where} (from {sorted(dists)}), not in [project].dependencies")
    assert not problems, "\n".join(problems)


def test_the_supervisor_is_the_bottom_layer():
    """minisgl/runtime/supervisor.py imports only the standard library: the server's launcher
    and the tp ranks in minisgl/scheduler/ both use it, and every import points down."""
    imported = {module for module, _, _ in _imports(PACKAGE / "runtime" / "supervisor.py")}
    assert imported <= {"__future__", *sys.stdlib_module_names}, imported


def test_the_checker_sees_lazy_and_module_level_imports(tmp_path):
    """The rule above is only as good as `_imports`: it must tell the two placements apart."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import httpx\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import openai\n"
        "def f():\n    import flashinfer.decode\n    from triton import jit\n"
    )
    assert _imports(sample) == [
        ("httpx", 1, False),
        ("typing", 2, False),
        ("flashinfer", 6, True),
        ("triton", 7, True),
    ]


def test_shell_runs_without_test_only_packages(tmp_path):
    """README's `python -m minisgl.server --shell`, with httpx made unimportable in every
    process of the stack: two exchanges, then /exit. Each reply stops at --shell-max-tokens or
    at what the context window leaves, whichever comes first (a bound past the window would be
    a 400); a cut reply stays out of the history the next question is sent with. The bundled
    model writes real text, which encodes back to the tokens it came from (give or take one)."""
    from transformers import AutoTokenizer

    from minisgl.shell import CUT

    model_dir = require_default_model()
    blocker = tmp_path / "blocked" / "httpx"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError('httpx is a test-only dependency of minisgl')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocker.parent), str(ROOT)]),
        "PYTHONUNBUFFERED": "1",
    }
    context_len, most = 64, 24
    # The first asks for more than --shell-max-tokens; the second is long enough that the window
    # leaves less than that for its reply.
    questions = ["Tell me a long story about the sea.", "Another story about the sea, please. " * 2]
    args = ["--shell", *TEST_SERVER_FLAGS, "--temperature", "0"]
    args += ["--max-model-len", str(context_len), "--shell-max-tokens", str(most)]
    result = subprocess.run(
        [sys.executable, "-m", "minisgl.server", *args],
        input="\n".join([*questions, "/exit"]) + "\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=SHELL_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "chatting with" in result.stdout
    assert result.stdout.count(">>> ") == 3, result.stdout  # two questions, then /exit
    assert "[error]" not in result.stdout and "Traceback" not in result.stderr, result.stdout
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    replies = [part.rstrip("\n") for part in result.stdout.split(">>> ")[1:3]]
    cut = [reply.endswith(CUT) for reply in replies]
    replies = [reply.removesuffix(CUT) for reply in replies]
    num_tokens = [len(tokenizer.encode(reply)) for reply in replies]
    first_exchange = [
        {"role": "user", "content": questions[0]},
        {"role": "assistant", "content": replies[0]},
    ]
    history = [] if cut[0] else first_exchange
    conversation = [*history, {"role": "user", "content": questions[1]}]
    room = context_len - len(
        tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    )
    assert room < most, room  # the second reply is cut by the window, not the flag
    # +1: a token may split in two when decoded alone
    assert 0 < num_tokens[0] <= most + 1, replies
    assert num_tokens[1] <= room + 1, (replies, room)


def test_the_server_side_imports_no_scheduler_module():
    """api/ and runtime/ reach the scheduler only through the messages (docs/architecture.md):
    the scheduler process is started by its entry point's name, never imported here."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for part in ("api", "runtime")
        for path in sorted((PACKAGE / part).rglob("*.py"))
        for module, line, _ in _imports(path, full_names=True)
        if module.startswith("minisgl.scheduler")
    ]
    assert not found, found
