#!/usr/bin/env bash
# One call on a GPU machine for the FP8 backward's GEMM forms (notes/fp8.md, "The backward's GEMM
# forms on the GPU"): build their targets, check ptxas, run their GPU tests (the FP8 quantizers bit
# for bit against the spec, Fp8Wgrad, Fp8Dgrad, and the bf16 wgrad / dgrad + SwiGLU forms they
# share code with), then the backward chain (mok_fp8_backward_bench: bf16 vs FP8 per EP-8 rank
# slice, the operand passes timed) and every backward GEMM form in both precisions with torch in
# the same run (mok_gemm_bench --filter grad + torch_baseline.py + make_json.py).
# Everything lands in $OUT (default /tmp/fp8-backward-out): log.txt (also written as it goes, so a
# call cut short keeps it), the tests' logs, fp8-backward-chain.json, gemm-fp8-backward.json.
# With FP8_BWD_NCU=1 (default) also Nsight Compute over the FP8 dgrad + SwiGLU kernel (ncu_*.txt).
#   [FP8_BWD_BENCH=0] [FP8_BWD_NCU=0] [MOK_COMMIT=<sha>] bench/fp8_backward_device.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/fp8-backward-out}"
mkdir -p "$OUT"
B="${MOK_BUILD:-$ROOT/build/fp8-backward-device}"
LOG="$OUT/log.txt"
log() { echo "$@" | tee -a "$LOG"; }
gtest_args=()
[ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest_args=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest_args[@]}" >"$OUT/build.log" 2>&1 || log "CONFIGURE FAILED"
cmake --build "$B" -j "$(nproc)" --target mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_gemm_bench \
  mok_fp8_backward_bench -- -k 0 >>"$OUT/build.log" 2>&1 ||
  { log "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -20 | tee -a "$LOG"; exit 1; }
log "build: $(( $(date +%s) - t0 )) s"
python3 tools/ptxas_check.py --build-dir "$B" --allow tools/ptxas_allow.txt >"$OUT/ptxas.txt" 2>&1
log "ptxas_check rc=$? ($(tail -1 "$OUT/ptxas.txt"))"
run_test() {  # binary filter name
  local t1 rc
  t1=$(date +%s)
  timeout 300 "$B/tests/gpu/gemm/$1" --gtest_filter="$2" >"$OUT/$3.log" 2>&1
  rc=$?
  log "$3: rc $rc ($(( $(date +%s) - t1 )) s) $(grep -hE '^\[  (PASSED|FAILED) ' "$OUT/$3.log" | tr '\n' ' ')"
  grep -hE "^\[fp8 (wgrad|dgrad|quantize)|FAILED  \]|Failure|Expected|Which is" "$OUT/$3.log" | head -30 | tee -a "$LOG"
}
run_test mok_gpu_gemm_primitive_tests 'Fp8*' t_quantize
run_test mok_gpu_gemm_tests 'Fp8Wgrad*:Fp8Dgrad*:Fp8Grouped*:*Wgrad*:DgradSwiGLURouter*' t_forms
if [ "${FP8_BWD_BENCH:-1}" = 1 ]; then
  t1=$(date +%s)
  timeout 200 "$B/bench/gemm/mok_fp8_backward_bench" --reps 20 --commit "${MOK_COMMIT:-unknown}" --out "$OUT/fp8-backward-chain.json" >"$OUT/chain.log" 2>&1
  log "backward chain: rc $? ($(( $(date +%s) - t1 )) s)"
  grep -vE "^    " "$OUT/chain.log" | tee -a "$LOG"
  t1=$(date +%s)
  timeout 200 "$B/bench/gemm/mok_gemm_bench" --filter grad --reps 20 --out "$OUT/mok_bwd.json" >"$OUT/gemm.log" 2>&1
  log "backward forms: rc $? ($(( $(date +%s) - t1 )) s)"
  timeout 200 python3 bench/gemm/torch_baseline.py --cases "$OUT/mok_bwd.json" --out "$OUT/torch_bwd.json" \
    >"$OUT/torch.log" 2>&1
  log "torch baseline: rc $?"
  python3 bench/gemm/make_json.py --mok "$OUT/mok_bwd.json" --torch "$OUT/torch_bwd.json" \
    --out "$OUT/gemm-fp8-backward.json" --commit "${MOK_COMMIT:-unknown}" 2>&1 | tee -a "$LOG"
fi
# Where the FP8 dgrad + SwiGLU step's time goes (FP8_BWD_NCU=0 skips): Nsight Compute on that
# kernel (Fp8Mode 3) in the chain at DeepSeek-V3 2048 rows (weighted rows: router partials and hw
# written) and in the forms' benchmark (unweighted), issue slots, memory and warp stalls.
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
if [ "${FP8_BWD_NCU:-1}" = 1 ] && [ -n "$NCU" ]; then
  sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats
            --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio')
  for what in chain forms; do
    t1=$(date +%s)
    if [ "$what" = chain ]; then
      cmd=("$B/bench/gemm/mok_fp8_backward_bench" --filter dsv3/2048 --reps 1 --out /tmp/fp8_bwd_ncu.json)
    else
      cmd=("$B/bench/gemm/mok_gemm_bench" --filter dsv3-dgrad-fc2-swiglu_fp8/uniform/2048 --reps 2 --out /tmp/fp8_bwd_ncu2.json)
    fi
    timeout 240 "$NCU" --clock-control none --kernel-name-base mangled --kernel-name 'regex:fp8_grouped_kernel.*Fp8ModeE3E' \
      --launch-skip 2 \
      --launch-count 1 "${sections[@]}" "${cmd[@]}" >"$OUT/ncu_dgrad_swiglu_$what.txt" 2>&1
    log "ncu fp8 dgrad + SwiGLU ($what): rc $? ($(( $(date +%s) - t1 )) s)"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
      "$OUT/ncu_dgrad_swiglu_$what.txt" | head -12 | tee -a "$LOG"
    grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncu_dgrad_swiglu_$what.txt" | awk '{print $NF, $1}' | sort -gr | head -6 | tee -a "$LOG"
  done
fi
log "total $(( $(date +%s) - t0 )) s"
