#!/usr/bin/env bash
# One call on the GPU machine for the GEMM engine: build only its targets, run its GPU tests,
# check ptxas reports and SASS (HGMMA present, no local memory), then the benchmark: mok and
# torch (torch._grouped_mm, cuBLAS 8192^3) in the same call, merged into gemm-h200x1.json with the
# device's read ceiling (mok_read_ceiling) for the roofline.
# Everything lands in $OUT (log.txt, build.log, tests.log, mok.json, torch.json, read.json, gemm-h200x1.{json,png},
# and on request sass_fc1.txt / ncu.txt). Usage from the repo root:
#   [GEMM_SASS=1] [GEMM_NCU=1] [GEMM_SWEEP="args1;args2"] [GEMM_EXPERIMENTS="args1;args2"] \
#     bench/gemm/device.sh [bench args...]
# GEMM_EXPERIMENTS: extra mok_gemm_bench runs (e.g. "--quick --group-m 16"), tables into log.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
OUT="${OUT:-/tmp/gemm-out}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
B=build/gemm-device
LOG="$OUT/log.txt"
log() { echo "$@" | tee -a "$LOG"; }
{
  date -u
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used --format=csv
  nvcc --version | tail -1
} >>"$LOG" 2>&1
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_GTEST_SOURCE="$ROOT/.deps/googletest" \
  >"$OUT/build.log" 2>&1 || log "CONFIGURE FAILED"
cmake --build "$B" -j "$(nproc)" --target mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_gemm_bench mok_read_ceiling -- -k 0 \
  >>"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -20 | tee -a "$LOG"; }
log "build: $(( $(date +%s) - t0 )) s"
python3 tools/ptxas_check.py --build-dir "$B" --allow tools/ptxas_allow.txt >>"$LOG" 2>&1
log "ptxas_check rc=$?"
# SASS: per kernel, HGMMA / local-memory instruction counts; the FC1 kernel's listing.
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$B/bench/gemm/mok_gemm_bench" >"$OUT/sass_all.txt" 2>&1
  awk '/Function :/{f=$3} /[HQ]GMMA/{h[f]++} /LDL|STL/{l[f]++} /WARPGROUP.ARRIVE|WARPGROUP.DEPBAR/{w[f]++}
       END{for (k in h) printf "SASS %-80s GMMA %d  LDL/STL %d  warpgroup sync %d\n", substr(k,1,80), h[k], l[k]+0, w[k]+0}' \
    "$OUT/sass_all.txt" | tee -a "$LOG"
  [ "${GEMM_SASS:-0}" = 1 ] && awk '/Function :/{p=($3 ~ /FormFc1/)} p' "$OUT/sass_all.txt" >"$OUT/sass_fc1.txt"
  rm -f "$OUT/sass_all.txt"
fi
for t in mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests; do
  t1=$(date +%s)
  timeout 240 "$B/tests/gpu/gemm/$t" >"$OUT/$t.log" 2>&1
  rc=$?
  log "$t rc=$rc ($(( $(date +%s) - t1 )) s)"
  grep -E "^\[(fc1|fc2|dgrad|dgrad\+swiglu|wgrad)[] ]|FAILED|Failure|error|Expected|Which is|actual|want" "$OUT/$t.log" | head -40 | tee -a "$LOG"
done
cat "$OUT"/mok_gpu_gemm_*tests.log >"$OUT/tests.log"; rm -f "$OUT"/mok_gpu_gemm_*tests.log
# GEMM_SWEEP="argsA;argsB;...": quick-set runs of each variant; the one with the best geometric
# mean TFLOP/s is used for the full benchmark (and ncu).
best=""
IFS=';' read -ra sweep <<<"${GEMM_SWEEP:-}"
if [ ${#sweep[@]} -gt 0 ]; then
  i=0
  for v in "${sweep[@]}"; do
    # shellcheck disable=SC2086
    timeout 120 "$B/bench/gemm/mok_gemm_bench" --quick --reps 20 --out "/tmp/gemm_sweep_$i.json" $v >/dev/null 2>&1
    i=$((i + 1))
  done
  best=$(python3 - "${sweep[@]}" <<'PY'
import json, math, sys
best, best_g = "", -1.0
for i, v in enumerate(sys.argv[1:]):
    try:
        cs = json.load(open(f"/tmp/gemm_sweep_{i}.json"))["cases"]
    except Exception:
        continue
    ok = [c for c in cs if c["check_rel_err"] >= 0 and c["mok_tflops"] > 0]
    g = math.exp(sum(math.log(c["mok_tflops"]) for c in ok) / max(len(ok), 1)) if len(ok) == len(cs) else 0.0
    row = " ".join(f"{c['name'].replace('qwen3-','q')}={c['mok_tflops']:.0f}" for c in cs)
    print(f"sweep [{v}] geomean {g:.1f}: {row}", file=sys.stderr)
    if g > best_g:
        best, best_g = v, g
print(best)
PY
  2>>"$LOG")
  log "sweep choice: [$best]"
fi
# The read ceiling (a few seconds): the bound roofline.py applies to the weight-streaming cases.
t1=$(date +%s)
timeout 120 "$B/bench/gemm/mok_read_ceiling" --out "$OUT/read.json" >"/tmp/gemm_read.log" 2>&1
log "mok_read_ceiling rc=$? ($(( $(date +%s) - t1 )) s)"
cat /tmp/gemm_read.log >>"$LOG"
# Two alternating passes (mok, torch, mok, torch): each side's time is the mean of its passes,
# so both see the same thermal history.
for pass in 1 2; do
  t1=$(date +%s)
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 \
    >/tmp/gemm_clocks.csv 2>/dev/null &
  smi=$!
  # shellcheck disable=SC2086
  timeout 300 "$B/bench/gemm/mok_gemm_bench" --out "/tmp/gemm_mok$pass.json" $best "$@" >"/tmp/gemm_mok$pass.log" 2>&1
  log "mok_gemm_bench pass $pass rc=$? ($(( $(date +%s) - t1 )) s) with: $best $*"
  kill "$smi" 2>/dev/null
  awk -F, '$2 > 300 {c+=$1; p+=$2; n++} END{if(n) printf "  samples above 300 W: %d, SM clock avg %.0f MHz, power avg %.0f W\n", n, c/n, p/n}' \
    /tmp/gemm_clocks.csv | tee -a "$LOG"
  t1=$(date +%s)
  timeout 300 python3 bench/gemm/torch_baseline.py --cases "/tmp/gemm_mok$pass.json" --out "/tmp/gemm_torch$pass.json" \
    >"/tmp/gemm_torch$pass.log" 2>&1
  log "torch_baseline pass $pass rc=$? ($(( $(date +%s) - t1 )) s)"
done
cp /tmp/gemm_mok1.json "$OUT/mok.json"
cp /tmp/gemm_torch1.json "$OUT/torch.json" 2>/dev/null
cat /tmp/gemm_mok1.log /tmp/gemm_torch1.log /tmp/gemm_mok2.log /tmp/gemm_torch2.log >>"$LOG" 2>/dev/null
IFS=';' read -ra exps <<<"${GEMM_EXPERIMENTS:-}"
for e in "${exps[@]}"; do
  [ -z "$e" ] && continue
  log "== experiment: mok_gemm_bench $e"
  # shellcheck disable=SC2086
  timeout 120 "$B/bench/gemm/mok_gemm_bench" --out /tmp/gemm_exp.json $e 2>&1 | tee -a "$LOG" >/dev/null
done
if [ "${GEMM_NCU:-0}" = 1 ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats"
  for f in ${GEMM_NCU_CASES:-dsv3-fc1/uniform/2048}; do
    log "== ncu mok $f"
    # shellcheck disable=SC2086
    timeout 120 "$NCU" --clock-control none --kernel-name regex:grouped_gemm --launch-skip 4 --launch-count 1 $SECTIONS \
      "$B/bench/gemm/mok_gemm_bench" --filter "$f" --reps 6 --out /tmp/gemm_ncu.json $best >>"$OUT/ncu.txt" 2>&1
    log "ncu rc=$?"
    log "== ncu torch $f"
    # shellcheck disable=SC2086
    timeout 150 "$NCU" --clock-control none --kernel-name regex:'^(?!prepare).*([Gg]emm|cutlass)' --launch-skip 4 --launch-count 1 \
      $SECTIONS python3 bench/gemm/torch_baseline.py --cases /tmp/gemm_mok1.json --only "$f" --no-peak --reps 6 \
      --out /tmp/gemm_ncu_torch.json >>"$OUT/ncu.txt" 2>&1
    log "ncu rc=$?"
  done
fi
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
python3 bench/gemm/make_json.py --mok /tmp/gemm_mok1.json /tmp/gemm_mok2.json \
  --torch /tmp/gemm_torch1.json /tmp/gemm_torch2.json --out "$OUT/gemm-h200x1.json" --fp8-out "$OUT/gemm-fp8-h200x1.json" \
  --commit "${MOK_COMMIT:-unknown}" --read "$OUT/read.json" 2>&1 | tee -a "$LOG"
python3 bench/gemm/roofline.py "$OUT/gemm-h200x1.json" 2>&1 | tee -a "$LOG"
python3 bench/gemm/plot_gemm.py "$OUT/gemm-h200x1.json" "$OUT/gemm-h200x1.png" 2>&1 | tee -a "$LOG"
