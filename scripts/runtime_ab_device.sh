#!/usr/bin/env bash
# Issue 18's closing call on one GPU, from prebuilt binaries (no build on the device): every GPU
# test binary, then the main job's forward A/B against a base build (issue 18: c5c4276) at all
# three models and T = 2048 and 8192, the builds alternated ROUNDS times, with the forward's output
# hashes compared (bench/ab_report.py via knobs_ab.sh's BASE_COMMIT). Here first:
#   scripts/prebuilt.sh pack                 (the default GPU test binaries and mok_bench)
#   scripts/prebuilt.sh pack-base c5c4276    (the base's mok_bench into devrun/base/)
# then, with carry ["devrun"] (names the GPU in the result file: h200x1 / h100x1):
#   [ROUNDS=3] [LIMIT=600] [SKIP_TESTS=1] scripts/runtime_ab_device.sh
# Writes $OUT/tests/<binary>.log with a summary line each, and $OUT/ab/runtime-ab-<gpu>.json
# (bench/results/ takes it as is). The A/B gets what the tests leave of LIMIT; a test binary
# gets at most 150 s.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/prebuilt.sh env
OUT="${OUT:-/tmp/runtime-ab-out}"
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null; }
[ -x devrun/bin/mok_bench ] && [ -x devrun/base/mok_bench ] || {
  echo "runtime_ab_device: needs devrun/bin/mok_bench and devrun/base/mok_bench (scripts/prebuilt.sh pack, pack-base)" >&2
  exit 2
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
case "$gpu" in *H200*) tag=h200x1 ;; *H100*) tag=h100x1 ;; *) tag=gpux1 ;; esac
echo "$gpu ($tag); new $(head -1 devrun/commit), base $(head -1 devrun/base/commit)"
mkdir -p "$OUT/tests" "$OUT/ab"
if [ -z "${SKIP_TESTS:-}" ]; then
  for b in devrun/bin/mok_gpu_*; do
    [ -x "$b" ] || continue
    n="$(basename "$b")"
    timeout 150 "$b" >"$OUT/tests/$n.log" 2>&1
    rc=$?
    echo "$n rc=$rc: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]|^\[  SKIPPED \] [0-9]' "$OUT/tests/$n.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \] [A-Z]' "$OUT/tests/$n.log" | head -5
    pack
  done
fi
el "forward A/B against $(head -1 devrun/base/commit)"
OUT="$OUT/ab" BENCH=devrun/bin/mok_bench MOK_COMMIT="$(head -1 devrun/commit)" BASE_COMMIT="$(head -1 devrun/base/commit)" \
  VARIANTS="base:BENCH=devrun/base/mok_bench new:" FIELD=mok_ms EXTRA=--no-backward \
  MODELS=dsv3,qwen3-235b,qwen3-30b-a3b TOKENS=2048,8192 ROUNDS="${ROUNDS:-3}" OUT_NAME="runtime-ab-$tag" \
  timeout $(( ${LIMIT:-600} - 10 - ($(date +%s) - T0) )) bench/knobs_ab.sh >"$OUT/ab/knobs_ab.log" 2>&1
echo "rc=$?"
tail -9 "$OUT/ab/knobs_ab.log"
pack
el done
