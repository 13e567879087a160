#!/usr/bin/env bash
# One call on a GPU machine for the FP8 layer (notes/fp8.md): build, the FP8 GPU tests (GEMM
# primitives and forms, the layer's FP8 forward against the CPU reference and its refusals), the
# sanitizers over the FP8 layer case, the FP8 GEMM forms (the dgrad shapes too) under a stagger
# sweep, then mok_bench's FP8 forward beside the bf16 megakernel and the bf16 unfused path on the
# same shapes, alternating (two rounds), with one line per case, and a comm-SM sweep of the FP8
# megakernel.
# Everything lands in $OUT (default /tmp/fp8-out): log.txt, the tests' logs, the mok_bench JSONs.
#   [FP8_MODELS=dsv3,qwen3-235b] [FP8_TOKENS=8192] [FP8_SKEWS="0 1"] [FP8_SANITIZE=0] [FP8_NCU=0]
#   bench/fp8_device.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/fp8-out}"
mkdir -p "$OUT"
B="${MOK_BUILD:-$ROOT/build/fp8-device}"
LOG="$OUT/log.txt"
log() { echo "$@" | tee -a "$LOG"; }
gtest_args=()
[ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest_args=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest_args[@]}" >"$OUT/build.log" 2>&1 || log "CONFIGURE FAILED"
cmake --build "$B" -j "$(nproc)" --target mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_gpu_layer_tests mok_bench mok_gemm_bench \
  -- -k 0 >>"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -20 | tee -a "$LOG"; exit 1; }
log "build: $(( $(date +%s) - t0 )) s"
run_test() {  # binary filter name
  local t1 rc
  t1=$(date +%s)
  timeout 300 "$B/tests/gpu/$1" --gtest_filter="$2" >"$OUT/$3.log" 2>&1
  rc=$?
  log "$3: rc $rc ($(( $(date +%s) - t1 )) s) $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$3.log" | tr '\n' ' ')"
  grep -E "^\[(fp8|layer fp8)|FAILED  \]|Failure|Expected|Which is|actual" "$OUT/$3.log" | head -30 | tee -a "$LOG"
}
run_test gemm/mok_gpu_gemm_primitive_tests 'Fp8*' primitives
run_test gemm/mok_gpu_gemm_tests 'Fp8*' gemm
run_test megakernel/mok_gpu_layer_tests '*LayerFp8*' layer
if [ "${FP8_SANITIZE:-1}" = 1 ]; then
t1=$(date +%s)
MOK_BUILD="$B" MOK_SANITIZE_NO_BUILD=1 MOK_SANITIZE_ONLY='^fwd_fp8$' OUT="$OUT/sanitize" \
  bash scripts/sanitize.sh >"$OUT/sanitize.log" 2>&1
log "sanitizers over the FP8 layer case: rc $? ($(( $(date +%s) - t1 )) s)"
grep -E "^(memcheck|racecheck|synccheck|initcheck) " "$OUT/sanitize.log" | tee -a "$LOG"
fi
# The FP8 forms with the warpgroup stagger (Options::skew_stages; 1 = the FP8 forms' default), 512
# rows/expert; FP8_SKEWS picks the settings.
for sk in ${FP8_SKEWS:-0 1 2 3 0}; do
  timeout 120 "$B/bench/gemm/mok_gemm_bench" --quick --filter fp8 --skew "$sk" --reps 20 --out "$OUT/gemm_skew$sk.json" \
    >"$OUT/gemm_skew$sk.log" 2>&1
  log "mok_gemm_bench fp8 --skew $sk: rc $? $(grep -E 'fp8 ' "$OUT/gemm_skew$sk.log" | awk '{printf "%s=%s ", $1, $6}')"
done
models="${FP8_MODELS:-dsv3,qwen3-30b-a3b,qwen3-235b,dsv3/ep8}"
tokens="${FP8_TOKENS:-8192}"
common=(--models "$models" --tokens "$tokens" --routings uniform --no-ablation --no-backward --sustain 0)
for round in 1 2; do
  for v in megakernel unfused fp8 fp8mk; do
    case "$v" in
      megakernel) extra=(--workspace-budget 0) ;;
      unfused) extra=(--path unfused) ;;
      fp8) extra=(--path unfused --precision fp8) ;;
      fp8mk) extra=(--precision fp8 --workspace-budget 0) ;;
    esac
    t1=$(date +%s)
    timeout 300 "$B/bench/mok_bench" "${common[@]}" "${extra[@]}" --json "$OUT/fwd_${v}_$round.json" \
      >"$OUT/fwd_${v}_$round.log" 2>&1
    log "mok_bench $v round $round: rc $? ($(( $(date +%s) - t1 )) s)"
    grep -E "^\| (dsv3|qwen3)" "$OUT/fwd_${v}_$round.log" | tee -a "$LOG"
  done
done
# The FP8 megakernel's comm-SM share (FP8 moves ~half the bytes per row, so the bf16 choice may
# leave compute SMs idle-waiting on fewer bytes): one run per setting, 0 = the shape's choice.
for cs in 4 8 12 16 24; do
  timeout 300 "$B/bench/mok_bench" "${common[@]}" --precision fp8 --workspace-budget 0 --comm-sms "$cs" \
    --json "$OUT/fwd_fp8mk_cs$cs.json" >"$OUT/fwd_fp8mk_cs$cs.log" 2>&1
  log "mok_bench fp8mk --comm-sms $cs: rc $? $(grep -E '^\| (dsv3|qwen3)' "$OUT/fwd_fp8mk_cs$cs.log" | awk -F'|' '{printf "%s=%s ", $2, $10}')"
done
# Where the FP8 megakernel's time goes, beside the bf16 one (FP8_NCU=0 skips): Nsight Compute on the
# 4th forward of the DeepSeek-V3 EP-8 slice, tensor-pipe use, issue slots and warp stalls.
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
if [ "${FP8_NCU:-1}" = 1 ] && [ -n "$NCU" ]; then
  for v in bf16 fp8; do
    t1=$(date +%s)
    timeout 240 "$NCU" --clock-control none --kernel-name regex:forward_megakernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      "$B/bench/mok_bench" --models dsv3/ep8 --tokens 8192 --routings uniform --no-ablation --no-backward --sustain 0 \
      --workspace-budget 0 --precision "$v" >"$OUT/ncu_$v.txt" 2>&1
    log "ncu $v megakernel: rc $? ($(( $(date +%s) - t1 )) s)"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Issued Ipc Active|Tensor|No Eligible|Warp Cycles Per Issued" \
      "$OUT/ncu_$v.txt" | head -20 | tee -a "$LOG"
    # The warps' stall reasons (cycles per issued instruction), largest first.
    grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncu_$v.txt" | awk '{print $NF, $1}' | sort -gr | head -8 | tee -a "$LOG"
  done
fi
python3 bench/ab_report.py --out "$OUT/fp8-forward-ab.json" --commit "${MOK_COMMIT:-unknown}" --field mok_ms \
  --variant bf16-megakernel="$OUT/fwd_megakernel_*.json" --variant bf16-unfused="$OUT/fwd_unfused_*.json" \
  --variant fp8-unfused="$OUT/fwd_fp8_[0-9].json" --variant fp8-megakernel="$OUT/fwd_fp8mk_[0-9].json" \
  --what "the layer's forward at EP 1 (T = $tokens, uniform): the bf16 megakernel (every row resident), the bf16 unfused path, the FP8 unfused path and the FP8 megakernel (Config::precision FP8)" \
  2>&1 | tee -a "$LOG"
