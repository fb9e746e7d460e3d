#!/usr/bin/env bash
# The peer check, for a session lent the CUDA device (see docs/development.md): minisgl against
# Mini-SGLang on the same random Qwen3-0.6B-shaped bf16 checkpoint and Mini-SGLang's offline
# workload (256 requests, input and output lengths uniform in 100..1024, ignore_eos, greedy),
# each engine in a fresh process with an untimed warm-up (benchmark/offline/peer.py).
#   here:   bash scripts/fetch_gpu_wheels.sh && bash scripts/fetch_peer.sh
#   device: run(command="bash scripts/peer_check.sh", carry=[".whl", ".fi_aot", ".peer"],
#               timeout_s=420)
# or as the `peer` step of scripts/gpu_check.sh (it runs this when .peer/mini-sglang exists).
#   bash scripts/peer_check.sh [PEER_SOURCE]      (default .peer/mini-sglang)
# Mini-SGLang compiles its small kernels with nvcc (through apache-tvm-ffi and ninja) and
# FlashInfer's for its own settings on first use: its start-up takes minutes on a fresh machine.
# Prints one table last: engine, settings, seconds, output tok/s, ratio (minisgl / Mini-SGLang).
# $OUT gets peer.json (both results), peer_logs.tar.gz and, when FlashInfer compiled anything,
# fi_aot.tar (unpack into .fi_aot here, as after gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PEER_SOURCE=${1:-.peer/mini-sglang}
PEER_WHL=${PEER_WHL:-.peer/whl}
PEER_BUDGET_S=${PEER_BUDGET_S:-400}  # the whole script; an engine gets at most the next
PEER_CHILD_LIMIT_S=${PEER_CHILD_LIMIT_S:-330}
LOG_DIR=${PEER_LOG_DIR:-/tmp/peer_check}
RETURN_DIR=${OUT:-/tmp/peer_check_out}
SITE=${SITE:-/tmp/site}
MODEL=${MODEL:-/tmp/qwen3-0.6b}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
source scripts/fi_aot.sh
mkdir -p "$LOG_DIR" "$RETURN_DIR" && rm -f "$LOG_DIR/compare.log"  # no stale table
results=()
note() { results+=("$(printf '%-28s %-8s %5ss' "$1" "$2" "$3")"); }
finish() {
  pack_fi_aot "$RETURN_DIR/fi_aot.tar"  # FlashInfer modules compiled here (unpack into .fi_aot)
  tar -czf "$RETURN_DIR/peer_logs.tar.gz" -C "$LOG_DIR" . 2>/dev/null || true
  echo
  echo "== peer_check summary (${SECONDS}s) =="
  printf '%s\n' "${results[@]}"
  [ -f "$LOG_DIR/compare.log" ] && sed -n '/^==== peer check/,$p' "$LOG_DIR/compare.log"
  exit "${1:-0}"
}

if [ ! -d "$PEER_SOURCE/python/minisgl" ] && [ ! -d "$PEER_SOURCE/minisgl" ]; then
  echo "no Mini-SGLang source at $PEER_SOURCE (run scripts/fetch_peer.sh here first)"
  note peer_source FAIL 0
  finish 1
fi
echo "Mini-SGLang: $(cat "$PEER_SOURCE/COMMIT" 2>/dev/null || echo "$PEER_SOURCE")"

# The carried wheels (flashinfer, tvm-ffi, tokenizer from .whl; pyzmq, msgpack, ninja from
# .peer/whl) into one target folder both engines' children see; gpu_check.sh may have
# installed .whl already.
shopt -s nullglob
wheels=()
[ -d "$SITE/flashinfer" ] || { [ -d .whl ] && wheels+=(.whl/*.whl); }
[ -d "$PEER_WHL" ] && wheels+=("$PEER_WHL"/*.whl)
if [ "${#wheels[@]}" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" > "$LOG_DIR/install.log" 2>&1 \
    || { tail -n 5 "$LOG_DIR/install.log"; note install FAIL "$SECONDS"; finish 1; }
fi
export PYTHONPATH="$PWD:$SITE"
load_fi_aot "$SITE"  # FlashInfer modules compiled by an earlier run (.fi_aot)
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvm_ffi_cache}
command -v ninja > /dev/null || export PATH="$SITE/bin:$PATH"  # the ninja wheel's launcher
if ! command -v nvcc > /dev/null && [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
echo "python $(python3 -V 2>&1), ninja $(command -v ninja || echo missing)," \
  "nvcc $(command -v nvcc || echo "${CUDA_HOME:-missing}/bin/nvcc")"
python3 -c "import torch, flashinfer, tvm_ffi, zmq, msgpack; print('torch', torch.__version__, \
'flashinfer', flashinfer.__version__, 'tvm_ffi', tvm_ffi.__version__, 'pyzmq', zmq.__version__, \
'msgpack', msgpack.version)" || { note imports FAIL "$SECONDS"; finish 1; }

start=$SECONDS
if [ ! -f "$MODEL/config.json" ]; then
  echo "== make_model"
  timeout -k 5 120 python3 scripts/make_random_checkpoint.py "$MODEL" --preset qwen3-0.6b \
    --max-position-embeddings 4096 > "$LOG_DIR/make_model.log" 2>&1
  status=$?
  note make_model "$([ $status -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - start))
  [ $status -eq 0 ] || { tail -n 5 "$LOG_DIR/make_model.log"; finish 1; }
fi

left=$((PEER_BUDGET_S - SECONDS))
if [ "$left" -lt 90 ]; then
  note compare skipped 0
  finish 1
fi
# Ours runs first (about a minute with .fi_aot); the peer gets the rest of the budget.
echo "== compare (${left}s left, at most ${PEER_CHILD_LIMIT_S}s an engine, at ${SECONDS}s)"
start=$SECONDS
timeout -k 10 "$left" python3 benchmark/offline/peer.py --compare --model "$MODEL" \
  --peer-path "$PEER_SOURCE" --child-timeout-s "$PEER_CHILD_LIMIT_S" --budget-s $((left - 30)) \
  --json "$RETURN_DIR/peer.json" > "$LOG_DIR/compare.log" 2>&1
case $? in
  0) status=ok ;;
  124|137) status=TIMEOUT ;;
  *) status=FAIL ;;
esac
grep -q "FAILED\|SKIPPED" "$LOG_DIR/compare.log" && status=FAIL
note compare "$status" $((SECONDS - start))
[ "$status" = ok ] || grep -h "Traceback\|Error\|error:" "$LOG_DIR/compare.log" | tail -n 8
finish "$([ "$status" = ok ] && echo 0 || echo 1)"
