#!/usr/bin/env bash
# One call on a GPU machine (notes/fp8.md, "pipelined quarters"): builds the tree twice — the
# default (the scaled FP8 mainloop in m64n128 halves, one in flight) and with
# -DMOK_FP8_PIPELINED_QUARTERS=ON (m64n64 quarters, two in flight) — checks the second build's FP8
# tests (the same bits as the first: a k32 product sum does not depend on the wgmma's N), then
# alternates the FP8 megakernel forward of both builds (3 rounds, EP 1, T 8192, uniform, every row
# resident) and runs the FP8 grouped forms of both (mok_gemm_bench --quick --filter fp8).
# Everything lands in $OUT (default /tmp/fp8-pieces): log.txt, the JSONs, fp8-pieces-ab.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/fp8-pieces}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
log() { echo "$@" | tee -a "$LOG"; }
gtest_args=()
[ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest_args=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
targets=(--target mok_bench --target mok_gemm_bench --target mok_gpu_layer_tests --target mok_gpu_gemm_tests)
t0=$(date +%s)
build() {  # dir jobs [cmake args]
  local d="$1" j="$2"; shift 2
  cmake -S . -B "$d" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest_args[@]}" "$@" >"$OUT/$(basename "$d").log" 2>&1 &&
    cmake --build "$d" -j "$j" "${targets[@]}" >>"$OUT/$(basename "$d").log" 2>&1
}
build "$ROOT/build/pieces-halves" 8 -DMOK_FP8_PIPELINED_QUARTERS=OFF & p1=$!
build "$ROOT/build/pieces-quarters2" 8 -DMOK_FP8_PIPELINED_QUARTERS=ON & p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
log "builds: rc $r1 / $r2 ($(( $(date +%s) - t0 )) s)"
[ "$r1" = 0 ] && [ "$r2" = 0 ] || { grep -h -E "error" "$OUT"/pieces-*.log | head -10 | tee -a "$LOG"; exit 1; }
Q="$ROOT/build/pieces-quarters2"
timeout 120 "$Q/tests/gpu/gemm/mok_gpu_gemm_tests" --gtest_filter='Fp8*' >"$OUT/q_gemm.log" 2>&1
log "quarters2 Fp8 grouped tests: rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/q_gemm.log" | tr '\n' ' ')"
timeout 120 "$Q/tests/gpu/megakernel/mok_gpu_layer_tests" --gtest_filter='*LayerFp8*' >"$OUT/q_layer.log" 2>&1
log "quarters2 LayerFp8 tests: rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/q_layer.log" | tr '\n' ' ')"
grep -E "FAILED  \]|Failure" "$OUT/q_gemm.log" "$OUT/q_layer.log" | head -10 | tee -a "$LOG"
common=(--models "${FP8_MODELS:-dsv3,qwen3-30b-a3b,qwen3-235b,dsv3/ep8}" --tokens 8192 --routings uniform
        --no-ablation --no-backward --sustain 0 --workspace-budget 0 --precision fp8)
for round in 1 2 3; do
  for v in halves quarters2; do
    timeout 150 "$ROOT/build/pieces-$v/bench/mok_bench" "${common[@]}" --json "$OUT/mk_${v}_$round.json" \
      >"$OUT/mk_${v}_$round.log" 2>&1
    log "megakernel $v round $round: rc $? $(grep -E '^\| (dsv3|qwen3)' "$OUT/mk_${v}_$round.log" | awk -F'|' '{printf "%s=%s ", $2, $10}')"
  done
done
for v in halves quarters2; do
  timeout 120 "$ROOT/build/pieces-$v/bench/gemm/mok_gemm_bench" --quick --filter fp8 --reps 20 --out "$OUT/gemm_$v.json" \
    >"$OUT/gemm_$v.log" 2>&1
  log "grouped FP8 forms $v: rc $? $(grep -E 'fp8 ' "$OUT/gemm_$v.log" | awk '{printf "%s=%s ", $1, $6}')"
done
python3 bench/ab_report.py --out "$OUT/fp8-pieces-ab.json" --commit "${MOK_COMMIT:-unknown}" --field mok_ms \
  --base-commit "${MOK_COMMIT:-unknown} (halves)" \
  --variant halves="$OUT/mk_halves_*.json" --variant quarters2="$OUT/mk_quarters2_*.json" \
  --what "FP8 megakernel forward, EP 1, T 8192 uniform, resident: the scaled mainloop in m64n128 halves (default) vs pipelined m64n64 quarters (MOK_FP8_PIPELINED_QUARTERS=ON)" \
  2>&1 | tee -a "$LOG"
log "total $(( $(date +%s) - t0 )) s"
