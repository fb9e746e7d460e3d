#!/usr/bin/env bash
# The GPU check, for a session lent the CUDA device (see docs/development.md):
#   here:   bash scripts/fetch_gpu_wheels.sh      (flashinfer, tvm-ffi, Qwen3 tokenizer -> .whl)
#   device: run(command="CHECK_BUDGET_S=330 bash scripts/gpu_check.sh", carry=[".whl", ".fi_aot"],
#               timeout_s=400)
# A session has 15 minutes of device time, start-up included: a 400 s call leaves room for a
# rerun. Steps an earlier run already recorded can be skipped (SKIP_STEPS, below). Carrying .peer
# too (scripts/fetch_peer.sh) adds the `peer` step after the headline benchmarks: Mini-SGLang
# against minisgl (scripts/peer_check.sh, ~3-6 minutes), e.g. CHECK_BUDGET_S=520
# SKIP_STEPS="bench_matrix kernel_bench tests_moe tests_tiny_parity spec_bench" with
# timeout_s=560.
# It makes a random Qwen3-0.6B-shaped checkpoint, runs the CUDA tests (tests/test_cuda.py: each
# backend against torch-native, fp32/bf16 logits against transformers, graphs/overlap on/off give
# the same tokens), profiles a window of full-batch steps (benchmark/offline/profile_steps.py:
# host phases, GPU busy share, top kernels), then the offline benchmark on Mini-SGLang's workload
# (256 requests, input and output lengths uniform in 100..1024, ignore_eos): the best config
# with the fused layer kernels on and off, then per backend with overlap and graphs on/off,
# speculative decoding on vs off (bench_speculative.py), and prints one table last. A session
# whose device time is short skips what an earlier run already recorded, e.g.
# SKIP_STEPS="bench_matrix tests_moe spec_bench". Every step has a time limit and
# the whole run stops starting steps past CHECK_BUDGET_S, so it ends inside one 8-minute call.
#
# FlashInfer JIT-compiles its kernels with nvcc on first use (minutes). The compiled modules are
# packed into $OUT/fi_aot.tar; unpacked into .fi_aot/ here and carried, the next run loads them
# as FlashInfer's AOT modules and compiles nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
CHECK_BUDGET_S=${CHECK_BUDGET_S:-460}
# Logs stay here; $OUT (what comes back from the device, at most 8 files) gets one tarball of
# them, the compiled FlashInfer modules and the console output.
OUT_DIR=/tmp/gpu_check
RETURN_DIR=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT_DIR" "$RETURN_DIR"
SITE=/tmp/site
export PYTHONPATH="$PWD"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:$SITE"
fi
source scripts/fi_aot.sh
load_fi_aot "$SITE"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
MODEL=/tmp/qwen3-0.6b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || true

results=()
SKIP_STEPS=${SKIP_STEPS:-}  # e.g. "tests_moe kernel_bench": steps a rerun need not repeat
run() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local left=$((CHECK_BUDGET_S - SECONDS)) start=$SECONDS status
  if [ "$left" -lt 20 ] || [[ " $SKIP_STEPS " == *" $name "* ]]; then
    results+=("$(printf '%-28s %-8s %5ss' "$name" skipped 0)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout -k 5 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  case $? in
    0) status=ok ;;
    124|137) status=TIMEOUT ;;
    *) status=FAIL ;;
  esac
  results+=("$(printf '%-28s %-8s %5ss' "$name" "$status" $((SECONDS - start)))")
  tail -n 6 "$OUT_DIR/$name.log"
}

run make_model 120 python3 scripts/make_random_checkpoint.py "$MODEL" --preset qwen3-0.6b \
  --max-position-embeddings 4096
# Compile FlashInfer's kernels (an engine start plans and runs prefill and decode, and captures
# graphs) while the Triton and torch tests use the GPU.
# Graph capture compiles the decode module; a short generation compiles the prefill one too
# (also what tensor-core decode uses).
timeout 300 python3 -c "from minisgl import LLM, SamplingParams; \
llm = LLM('$MODEL', attention_backend='flashinfer', num_pages=512, max_running_requests=8); \
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2)); llm.shutdown(); print('flashinfer warm')" \
  > "$OUT_DIR/flashinfer_warmup.log" 2>&1 &
warmup_pid=$!
run tests_triton_torch 190 python3 -m pytest -q -s -x -p no:cacheprovider tests/test_cuda.py \
  tests/test_triton_sampling.py -k "not flashinfer"
wait "$warmup_pid"; echo "flashinfer warm-up exit $?, at ${SECONDS}s"; tail -n 3 "$OUT_DIR/flashinfer_warmup.log"
run tests_flashinfer 150 python3 -m pytest -q -s -x -p no:cacheprovider tests/test_cuda.py \
  -k flashinfer
# The headline figure first (a short session still gets it): the best config, and the same
# with the fused layer kernels off (torch ops for norms, rope, SiLU, KV store) for their effect.
BENCH_WORKLOAD=(--model "$MODEL" --num-requests 256 --page-size 16 --min-input-len 100
  --max-input-len 1024 --min-output-len 100 --max-output-len 1024)
run bench_best 100 python3 benchmark/offline/bench.py "${BENCH_WORKLOAD[@]}" \
  --attention-backend flashinfer --overlap on --cuda-graphs on
run bench_unfused 100 env MINISGL_FUSED_KERNELS=0 python3 benchmark/offline/bench.py \
  "${BENCH_WORKLOAD[@]}" --attention-backend flashinfer --overlap on --cuda-graphs on
# FP8 (issue 24): the block-FP8 GEMM compiled for CUDA against torch and transformers, its
# throughput against bf16 on the 0.6B (and 8B) shapes, and the offline workload on an fp8 KV pool.
run fp8 120 bash -c "python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8.py \
  -k 'kernel or cuts or gemm_model or fused_moe_fp8 or triton_attention' && \
  python3 benchmark/kernels/bench_fp8_gemm.py && python3 benchmark/kernels/bench_fp8_gemm.py \
  --model 8b --rows 1 64 256 4096"
run bench_fp8_kv 100 python3 benchmark/offline/bench.py "${BENCH_WORKLOAD[@]}" \
  --attention-backend flashinfer --overlap on --cuda-graphs on --kv-cache-dtype fp8_e4m3
# Mini-SGLang on the same checkpoint and workload (scripts/peer_check.sh), when its source and
# wheels were carried (.peer, from scripts/fetch_peer.sh): its own table follows this summary.
if [ -d .peer/mini-sglang ]; then
  peer_budget=$((CHECK_BUDGET_S - SECONDS - 10))
  [ "$peer_budget" -gt 420 ] && peer_budget=420
  run peer 430 env PEER_BUDGET_S="$peer_budget" SITE="$SITE" MODEL="$MODEL" \
    PEER_LOG_DIR="$OUT_DIR/peer" bash scripts/peer_check.sh
fi
# Where a step's time goes at full batch (host phases, GPU busy share, top kernels): the
# measured answer to "what limits throughput" (benchmark/RESULTS.md section 9).
PROFILE_WORKLOAD=(--model "$MODEL" --num-requests 256 --page-size 16 --min-input-len 100
  --max-input-len 1024 --min-output-len 100 --max-output-len 1024 --skip-steps 60 --steps 60)
run profile_flashinfer 90 python3 benchmark/offline/profile_steps.py "${PROFILE_WORKLOAD[@]}" \
  --attention-backend flashinfer --overlap on --cuda-graphs on
# Sampling alone (temperature rows take the Triton kernel; MINISGL_FUSED_KERNELS=0 the torch ops).
run sampling_bench 60 bash -c "python3 benchmark/kernels/bench_sampling.py --rows 1 64 256 && \
  MINISGL_FUSED_KERNELS=0 python3 benchmark/kernels/bench_sampling.py --rows 1 64 256"
run profile_flashinfer_eager 90 python3 benchmark/offline/profile_steps.py \
  "${PROFILE_WORKLOAD[@]}" --steps 20 --attention-backend flashinfer --overlap on --cuda-graphs off
# One process, a fresh engine per config: FlashInfer then Triton, each with graphs on/off and
# overlap on/off (results print as they finish, so a time limit still leaves the first ones).
run bench_matrix 400 python3 benchmark/offline/bench.py "${BENCH_WORKLOAD[@]}" --gpu-matrix \
  --backends flashinfer,triton
run kernel_bench 40 python3 benchmark/kernels/bench_attention.py
run tests_tiny_parity 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_model_parity.py \
  -k tiny
# The fused Triton MoE kernel compiled for CUDA (fp32 and bf16) and Qwen3-MoE HF parity through it
# (tp 2 needs two GPUs).
run tests_moe 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_moe.py \
  tests/test_moe.py --deselect "tests/test_moe.py::test_qwen3_moe_matches_hf[2]"
# Speculative decoding (issue 22) on the random checkpoint, drafts on vs off at batch 1 and 16
# (its greedy text repeats itself, so drafts are accepted): what verify rows cost on a GPU, for
# the GPU's draft-row cap (`MAX_VERIFY_ROWS` in minisgl/scheduler/speculative.py, unmeasured).
# Outputs are compared: in bf16 a near-tie may differ, a FAIL printed after the figures.
run spec_bench 150 python3 benchmark/offline/bench_speculative.py --model "$MODEL" --rounds 1 \
  --max-tokens 128

pack_fi_aot "$RETURN_DIR/fi_aot.tar"  # FlashInfer's compiled modules, for the next run
tar -czf "$RETURN_DIR/logs.tar.gz" -C "$OUT_DIR" . 2>/dev/null || true
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader || true

echo
echo "== gpu_check summary (${SECONDS}s) =="
printf '%s\n' "${results[@]}"
echo "-- benchmark: 256 requests, in/out uniform 100..1024, Qwen3-0.6B shape, bf16"
for name in bench_best bench_unfused bench_fp8_kv bench_matrix; do
  [ -f "$OUT_DIR/$name.log" ] && grep -h "^minisgl radix" "$OUT_DIR/$name.log" | grep "tok/s" \
    | sed "s/tokens in/tok,/; s/^/$name: /"
done
grep -h "GPU memory:\|captured" "$OUT_DIR"/bench_*.log 2>/dev/null | head -n 2
grep -h "bf16 |logprob" "$OUT_DIR"/tests_*.log 2>/dev/null
[ -f "$OUT_DIR/fp8.log" ] && sed -n '/^FP8 (Triton/,$p' "$OUT_DIR/fp8.log"
[ -f "$OUT_DIR/sampling_bench.log" ] && grep -h "rows\|temperature\|greedy" "$OUT_DIR/sampling_bench.log"
[ -f "$OUT_DIR/spec_bench.log" ] && sed -n '/^workload /,$p' "$OUT_DIR/spec_bench.log"
[ -f "$OUT_DIR/peer/compare.log" ] && sed -n '/^==== peer check/,$p' "$OUT_DIR/peer/compare.log"
for name in profile_flashinfer profile_flashinfer_eager; do
  [ -f "$OUT_DIR/$name.log" ] && sed -n '/^== /,$p' "$OUT_DIR/$name.log" | head -n 40
done
