#!/usr/bin/env bash
# One call on a GPU machine for the GPU layer's FP8 backward (notes/fp8.md, "The layer's backward
# in FP8"): build the layer's, the quantizers' and the GEMM forms' GPU tests, mok_bench and
# mok_fp8_backward_bench; run the quantizer tests (incl. MXFP8 re-blocked), the FP8 GEMM forms'
# and every weight gradient's tests, and the FP8 layer tests (forward, backward against the CPU
# FP8 / MXFP8 references, refusals); then the layer's backward in
# bf16, FP8 and MXFP8 on the unfused path, alternated ROUNDS times (mok_bench, EP-8 rank slices,
# uniform routing; and FP8 with the backward's weight codes kept), joined into fp8-layer-backward.json (mok_bwd_ms) and fp8-layer-forward.json (mok_ms)
# by ab_report.py; and the backward's GEMM chain with each step timed inside it.
# Everything lands in $OUT (default /tmp/fp8-layer-out); log.txt is written as it goes.
#   [ROUNDS=2] [MODELS=dsv3/ep8,qwen3-235b/ep8,qwen3-30b-a3b/ep8] [TOKENS=8192] [MOK_COMMIT=<sha>]
#   [FP8_LAYER_TESTS=1] [FP8_CHAIN=1] bench/fp8_layer_device.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/fp8-layer-out}"
mkdir -p "$OUT"
B="${MOK_BUILD:-$ROOT/build/fp8-layer-device}"
LOG="$OUT/log.txt"
COMMIT="${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
log() { echo "$@" | tee -a "$LOG"; }
gtest_args=()
[ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest_args=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest_args[@]}" >"$OUT/build.log" 2>&1 || log "CONFIGURE FAILED"
cmake --build "$B" -j "$(nproc)" --target mok_gpu_layer_tests mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_bench \
  mok_fp8_backward_bench -- -k 0 \
  >>"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -20 | tee -a "$LOG"; exit 1; }
log "build: $(( $(date +%s) - t0 )) s"
python3 tools/ptxas_check.py --build-dir "$B" --allow tools/ptxas_allow.txt >"$OUT/ptxas.txt" 2>&1
log "ptxas_check rc=$? ($(tail -1 "$OUT/ptxas.txt"))"
if [ "${FP8_LAYER_TESTS:-1}" = 1 ]; then
  t1=$(date +%s)
  timeout 200 "$B/tests/gpu/gemm/mok_gpu_gemm_primitive_tests" --gtest_filter='Fp8Cvt.*:Fp8Quantize.*' >"$OUT/t_quantize.log" 2>&1
  log "Fp8Cvt.*:Fp8Quantize.*: rc $? ($(( $(date +%s) - t1 )) s) $(grep -hE '^\[  (PASSED|FAILED) ' "$OUT/t_quantize.log" | tr '\n' ' ')"
  grep -hE "^\[fp8 quantize|FAILED  \]|Failure|Expected|Which is|error" "$OUT/t_quantize.log" | head -30 | tee -a "$LOG"
  t1=$(date +%s)
  # The FP8 GEMM forms (incl. FC1 with MX h) and every weight gradient.
  timeout 200 "$B/tests/gpu/gemm/mok_gpu_gemm_tests" --gtest_filter='Fp8*:*Wgrad*' >"$OUT/t_gemm_fp8.log" 2>&1
  log "Fp8*:*Wgrad*: rc $? ($(( $(date +%s) - t1 )) s) $(grep -hE '^\[  (PASSED|FAILED) ' "$OUT/t_gemm_fp8.log" | tr '\n' ' ')"
  grep -hE "^\[fp8 fc1|FAILED  \]|Failure|Expected|Which is" "$OUT/t_gemm_fp8.log" | head -30 | tee -a "$LOG"
  t1=$(date +%s)
  timeout 400 "$B/tests/gpu/megakernel/mok_gpu_layer_tests" --gtest_filter='*LayerFp8*:*Memory*' >"$OUT/t_layer_fp8.log" 2>&1
  log "*LayerFp8*:*Memory*: rc $? ($(( $(date +%s) - t1 )) s) $(grep -hE '^\[  (PASSED|FAILED) ' "$OUT/t_layer_fp8.log" | tr '\n' ' ')"
  grep -hE "^\[layer fp8|FAILED  \]|Failure|Expected|Which is|error" "$OUT/t_layer_fp8.log" | head -40 | tee -a "$LOG"
fi
MODELS="${MODELS:-dsv3/ep8,qwen3-235b/ep8,qwen3-30b-a3b/ep8}"
TOKENS="${TOKENS:-8192}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for p in bf16 fp8 fp8k mxfp8; do
    t1=$(date +%s)
    extra=(--precision "$p")
    [ "$p" = fp8k ] && extra=(--precision fp8 --fp8-keep-weight-codes)
    MOK_COMMIT="$COMMIT" timeout 300 "$B/bench/mok_bench" --models "$MODELS" --tokens "$TOKENS" --routings uniform \
      --path unfused "${extra[@]}" --no-ablation --sustain 0 --json "$OUT/ab_${p}_$round.json" \
      >"$OUT/bench_${p}_$round.log" 2>&1
    log "mok_bench $p round $round: rc $? ($(( $(date +%s) - t1 )) s)"
    grep -E "^\| |backward:|memory per layer" "$OUT/bench_${p}_$round.log" | grep -v "^| model\|^|---" | tee -a "$LOG"
  done
done
python3 bench/ab_report.py --out "$OUT/fp8-layer-backward.json" --commit "$COMMIT" --field mok_bwd_ms \
  --variant bf16="$OUT/ab_bf16_*.json" --variant fp8="$OUT/ab_fp8_*.json" \
  --variant fp8-kept="$OUT/ab_fp8k_*.json" --variant mxfp8="$OUT/ab_mxfp8_*.json" \
  --what "the GPU layer's backward (unfused path, resident) in bf16, FP8 (recipe 1; fp8-kept: the backward's weight codes made once per weight binding, Config::fp8_keep_weight_codes_t) and MXFP8 (recipe 2, re-blocked), EP 1 on EP-8 rank slices" \
  2>&1 | tee -a "$LOG"
python3 bench/ab_report.py --out "$OUT/fp8-layer-forward.json" --commit "$COMMIT" --field mok_ms \
  --variant bf16="$OUT/ab_bf16_*.json" --variant fp8="$OUT/ab_fp8_*.json" --variant mxfp8="$OUT/ab_mxfp8_*.json" \
  --what "the GPU layer's forward (unfused path) in bf16, FP8 (recipe 1) and MXFP8 (recipe 2, re-blocked), EP 1 on EP-8 rank slices" \
  2>&1 | tee -a "$LOG"
if [ "${FP8_CHAIN:-1}" = 1 ]; then
  t1=$(date +%s)
  timeout 200 "$B/bench/gemm/mok_fp8_backward_bench" --reps 20 --commit "$COMMIT" --out "$OUT/fp8-backward-chain.json" \
    >"$OUT/chain.log" 2>&1
  log "backward chain: rc $? ($(( $(date +%s) - t1 )) s)"
  cat "$OUT/chain.log" | tee -a "$LOG"
fi
log "total $(( $(date +%s) - t0 )) s"
