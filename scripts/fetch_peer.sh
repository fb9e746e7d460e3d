#!/usr/bin/env bash
# Run HERE (a machine with package access) before a peer check (scripts/peer_check.sh, see
# docs/development.md): puts Mini-SGLang's source and the wheels it needs beyond ours into the
# git-ignored .peer/, which the device call carries next to .whl (scripts/fetch_gpu_wheels.sh):
#   .peer/mini-sglang/   its source tree, exported from a git directory (a bare mirror or a
#                        clone; default: the fetched mirror below) or copied from a source folder
#   .peer/whl/           pyzmq and msgpack (its scheduler and message modules import them) and
#                        ninja (apache-tvm-ffi builds its small CUDA kernels with ninja + nvcc;
#                        used only where the device has no ninja), for CPython 3.12 on x86-64
# flashinfer-python and apache-tvm-ffi, which it also imports, come with .whl; sgl-kernel (its
# "fa" backend and MoE) and quack-kernels are not needed on the path the check runs.
#
#   bash scripts/fetch_peer.sh [GIT_DIR_OR_SOURCE_FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
SOURCE=${1:-/work/.mirror/sgl-project+mini-sglang/repo}
PEER=.peer/mini-sglang
rm -rf "$PEER" && mkdir -p "$PEER" .peer/whl
if git --git-dir="$SOURCE" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  git --git-dir="$SOURCE" archive HEAD | tar -x -C "$PEER"
  git --git-dir="$SOURCE" log -1 --format='%H %cI' > "$PEER/COMMIT"
elif git -C "$SOURCE" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  git -C "$SOURCE" archive HEAD | tar -x -C "$PEER"
  git -C "$SOURCE" log -1 --format='%H %cI' > "$PEER/COMMIT"
elif [ -d "$SOURCE/python/minisgl" ]; then
  cp -r "$SOURCE/." "$PEER/" && rm -rf "$PEER/.git"
  echo "copied from $SOURCE (no git metadata)" > "$PEER/COMMIT"
else
  echo "not a git directory or a Mini-SGLang source folder: $SOURCE" >&2
  exit 1
fi
rm -rf "$PEER/assets"  # its logo: carried bytes for nothing
[ -d "$PEER/python/minisgl/llm" ] || { echo "no python/minisgl/llm in $SOURCE" >&2; exit 1; }
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .peer/whl pyzmq==27.3.0 msgpack==1.2.4 ninja==1.13.2
echo "Mini-SGLang $(cat "$PEER/COMMIT")"
ls -la .peer/whl
du -sh "$PEER" .peer/whl
du -sh .peer  # carried as one path
[ -d .whl ] || echo "note: .whl is missing: run scripts/fetch_gpu_wheels.sh too (flashinfer, tvm-ffi)"
