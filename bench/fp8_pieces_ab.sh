#!/usr/bin/env bash
# One call on a GPU machine (notes/fp8.md, "the scaled mainloop's experiments"): builds the tree in
# four variants of the scaled FP8 mainloop — halves (the default: m64n128 pieces, one in flight),
# ordered (the two consumer warpgroups take turns issuing pieces, MOK_FP8_ORDERED_WARPGROUPS),
# quarters2 (m64n64 pieces, two in flight, MOK_FP8_PIPELINED_QUARTERS) and quarters2+ordered —
# by reconfiguring one build directory (only the two FP8 translation units recompile) and keeping
# each variant's binaries; checks every variant's FP8 tests (the same bits as the default: a k32
# product sum does not depend on the wgmma's N or on the issue order); runs the grouped FP8 forms
# of each (mok_gemm_bench --quick --filter fp8: the mainloop alone, every variant spill-free) and
# alternates the FP8 megakernel forward of each (EP 1, T 8192, uniform, resident; FP8_ROUNDS,
# default 2; the megakernel variants spill: quarters2 8 bytes, the ordered ones 156-208 bytes, so
# the grouped forms are the clean signal; ordered drops the forms' default
# stagger, which turns would deadlock).
# Everything lands in $OUT (default /tmp/fp8-pieces): log.txt, the JSONs, fp8-pieces-ab.json,
# fp8-pieces-gemm.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/fp8-pieces}"
B="${MOK_BUILD:-$ROOT/build/fp8-pieces}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
log() { echo "$@" | tee -a "$LOG"; }
gtest_args=()
[ -f "$ROOT/.deps/googletest/CMakeLists.txt" ] && gtest_args=(-DMOK_GTEST_SOURCE="$ROOT/.deps/googletest")
bins=(bench/mok_bench bench/gemm/mok_gemm_bench tests/gpu/megakernel/mok_gpu_layer_tests tests/gpu/gemm/mok_gpu_gemm_tests)
variants=(halves ordered quarters2 quarters2+ordered)
t0=$(date +%s)
for v in "${variants[@]}"; do
  q=OFF; o=OFF
  case "$v" in *quarters2*) q=ON ;; esac
  case "$v" in *ordered*) o=ON ;; esac
  t1=$(date +%s)
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gtest_args[@]}" -DMOK_FP8_PIPELINED_QUARTERS=$q \
    -DMOK_FP8_ORDERED_WARPGROUPS=$o >>"$OUT/build.log" 2>&1 &&
    cmake --build "$B" -j "$(nproc)" $(for b in "${bins[@]}"; do echo --target "$(basename "$b")"; done) \
      >>"$OUT/build.log" 2>&1
  rc=$?
  mkdir -p "$OUT/bin/$v"
  for b in "${bins[@]}"; do cp "$B/$b" "$OUT/bin/$v/" 2>/dev/null; done
  log "build $v (quarters2 $q, ordered $o): rc $rc ($(( $(date +%s) - t1 )) s)"
  [ "$rc" = 0 ] || { grep -E "error" "$OUT/build.log" | head -10 | tee -a "$LOG"; exit 1; }
done
for v in "${variants[@]}"; do
  timeout 120 "$OUT/bin/$v/mok_gpu_gemm_tests" --gtest_filter='Fp8*' >"$OUT/t_gemm_$v.log" 2>&1
  r1=$?
  timeout 120 "$OUT/bin/$v/mok_gpu_layer_tests" --gtest_filter='*LayerFp8*' >"$OUT/t_layer_$v.log" 2>&1
  log "$v FP8 tests: grouped rc $r1, layer rc $? $(grep -hE '^\[  (PASSED|FAILED) ' "$OUT/t_gemm_$v.log" "$OUT/t_layer_$v.log" | tr '\n' ' ')"
  grep -hE "FAILED  \]|Failure" "$OUT/t_gemm_$v.log" "$OUT/t_layer_$v.log" | head -6 | tee -a "$LOG"
done
for v in "${variants[@]}"; do
  timeout 120 "$OUT/bin/$v/mok_gemm_bench" --quick --filter fp8 --reps 20 --out "$OUT/gemm_$v.json" >"$OUT/gemm_$v.log" 2>&1
  log "grouped FP8 forms $v: rc $? $(grep -E 'fp8 ' "$OUT/gemm_$v.log" | awk '{printf "%s=%s ", $1, $6}')"
done
common=(--models "${FP8_MODELS:-dsv3,qwen3-30b-a3b,qwen3-235b,dsv3/ep8}" --tokens 8192 --routings uniform
        --no-ablation --no-backward --sustain 0 --workspace-budget 0 --precision fp8)
for round in $(seq 1 "${FP8_ROUNDS:-2}"); do
  for v in "${variants[@]}"; do
    timeout 150 "$OUT/bin/$v/mok_bench" "${common[@]}" --json "$OUT/mk_${v}_$round.json" >"$OUT/mk_${v}_$round.log" 2>&1
    log "megakernel $v round $round: rc $? $(grep -E '^\| (dsv3|qwen3)' "$OUT/mk_${v}_$round.log" | awk -F'|' '{printf "%s=%s ", $2, $10}')"
  done
done
ab=()
for v in "${variants[@]}"; do ab+=(--variant "$v=$OUT/mk_${v}_*.json"); done
python3 bench/ab_report.py --out "$OUT/fp8-pieces-ab.json" --commit "${MOK_COMMIT:-unknown}" --field mok_ms "${ab[@]}" \
  --what "FP8 megakernel forward, EP 1, T 8192 uniform, resident, alternated: the scaled mainloop's variants (halves = the default; ordered = MOK_FP8_ORDERED_WARPGROUPS; quarters2 = MOK_FP8_PIPELINED_QUARTERS)" \
  2>&1 | tee -a "$LOG"
python3 - "$OUT" "${variants[@]}" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
out, variants = sys.argv[1], sys.argv[2:]
runs = {v: json.load(open(f"{out}/gemm_{v}.json")) for v in variants}
cases = []
for i, c in enumerate(runs[variants[0]]["cases"]):
    row = {"name": c["name"], "rows_per_expert": c["rows_per_expert"]}
    for v in variants:
        row[v + "_tflops"] = runs[v]["cases"][i]["mok_tflops"]
    cases.append(row)
    print(c["name"], " ".join(f"{v}={row[v + '_tflops']}" for v in variants))
json.dump({"device": runs[variants[0]].get("device"), "what": "mok_gemm_bench --quick --filter fp8 per variant of the scaled mainloop (one run each)",
           "cases": cases}, open(f"{out}/fp8-pieces-gemm.json", "w"), indent=1)
PY
log "total $(( $(date +%s) - t0 )) s"
