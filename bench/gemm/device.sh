#!/usr/bin/env bash
# One call on the GPU machine for the GEMM engine: build only its targets, run its GPU tests,
# check ptxas reports and SASS (HGMMA present, no local memory), then the benchmark: mok and
# torch (torch._grouped_mm, cuBLAS 8192^3) in the same call, merged into gemm-h200x1.json.
# Everything lands in $OUT (log.txt, build.log, sass_mainloop.txt, mok.json, torch.json,
# gemm-h200x1.json). Usage from the repo root: bench/gemm/device.sh [mok_gemm_bench args...]
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
cmake --build "$B" -j "$(nproc)" -k 0 --target mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_gemm_bench \
  >>"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -20 | tee -a "$LOG"; }
log "build: $(( $(date +%s) - t0 )) s"
python3 tools/ptxas_check.py --build-dir "$B" --allow tools/ptxas_allow.txt >>"$LOG" 2>&1
log "ptxas_check rc=$?"
# SASS: per kernel, HGMMA / local-memory instruction counts; the FC1 kernel's listing.
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$B/bench/gemm/mok_gemm_bench" >"$OUT/sass_all.txt" 2>&1
  awk '/Function :/{f=$3} /HGMMA/{h[f]++} /LDL|STL/{l[f]++} /WARPGROUP.ARRIVE|WARPGROUP.DEPBAR/{w[f]++}
       END{for (k in h) printf "SASS %-80s HGMMA %d  LDL/STL %d  warpgroup sync %d\n", substr(k,1,80), h[k], l[k]+0, w[k]+0}' \
    "$OUT/sass_all.txt" | tee -a "$LOG"
  awk '/Function :/{p=($3 ~ /FormFc1/)} p' "$OUT/sass_all.txt" >"$OUT/sass_fc1.txt"
  rm -f "$OUT/sass_all.txt"
fi
for t in mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests; do
  t1=$(date +%s)
  timeout 240 "$B/tests/gpu/gemm/$t" >"$OUT/$t.log" 2>&1
  rc=$?
  log "$t rc=$rc ($(( $(date +%s) - t1 )) s)"
  grep -E "^\[(fc1|fc2|dgrad|wgrad)\]|FAILED|Failure|error|Expected|Which is|actual|want" "$OUT/$t.log" | head -40 | tee -a "$LOG"
done
cat "$OUT"/mok_gpu_gemm_*tests.log >"$OUT/tests.log"; rm -f "$OUT"/mok_gpu_gemm_*tests.log
t1=$(date +%s)
timeout 420 "$B/bench/gemm/mok_gemm_bench" --out "$OUT/mok.json" "$@" >"$OUT/mok_bench.log" 2>&1
log "mok_gemm_bench rc=$? ($(( $(date +%s) - t1 )) s)"
t1=$(date +%s)
timeout 300 python3 bench/gemm/torch_baseline.py --cases "$OUT/mok.json" --out "$OUT/torch.json" >"$OUT/torch.log" 2>&1
log "torch_baseline rc=$? ($(( $(date +%s) - t1 )) s)"
cat "$OUT/mok_bench.log" "$OUT/torch.log" >>"$LOG"; rm -f "$OUT/mok_bench.log" "$OUT/torch.log"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
python3 bench/gemm/make_json.py --mok "$OUT/mok.json" --torch "$OUT/torch.json" --out "$OUT/gemm-h200x1.json" \
  --commit "${MOK_COMMIT:-unknown}" 2>&1 | tee -a "$LOG"
