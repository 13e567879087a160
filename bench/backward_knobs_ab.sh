#!/usr/bin/env bash
# A/B of the backward's environment knobs in one device call (METHOD.md: same binary, the variants
# alternated): mok_bench on every visible GPU (EP = the GPU count, one rank per GPU) with each
# knob setting in turn, ROUNDS times, then bench/ab_report.py joins the runs by case. The knobs
# (read when a layer is built; notes/backward.md): MOK_BWD_PULL_AHEAD and MOK_BWD_PUSH_BESIDE (the
# movement beside the GEMMs, default on at EP > 1), MOK_BWD_STREAMS (the side stream),
# MOK_BWD_HOLD (held rows). The first variant is the reference.
#   VARIANTS="ahead_off:MOK_BWD_PULL_AHEAD=0 ahead_on:MOK_BWD_PULL_AHEAD=1" [ROUNDS=2] \
#   [MODELS=dsv3,qwen3-235b] [TOKENS=8192] [ROUTINGS=uniform] [MOK_COMMIT=<sha>] \
#   [OUT_NAME=backward-knobs-ab] bench/backward_knobs_ab.sh
# A variant is NAME:VAR=VALUE[,VAR=VALUE...]. Writes $OUT/<name>_r<round>.json per run,
# $OUT/$OUT_NAME.json (the joined report) and prints its table.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/backward-knobs-out}"
mkdir -p "$OUT"
: "${VARIANTS:?VARIANTS=\"name:VAR=VALUE[,VAR=VALUE] ...\" (the first is the reference)}"
ROUNDS="${ROUNDS:-2}"
source scripts/common.sh
mok_ensure_deps
mok_build --target mok_bench >"$OUT/build.log" 2>&1 || { echo "backward_knobs_ab: build failed (see $OUT/build.log)" >&2; exit 1; }
bench="$MOK_BUILD/bench/mok_bench"
args=(--models "${MODELS:-dsv3,qwen3-235b}" --tokens "${TOKENS:-8192}" --routings "${ROUTINGS:-uniform}"
      --no-ablation --sustain 0)
report=()
for v in $VARIANTS; do
  report+=(--variant "${v%%:*}=$OUT/${v%%:*}_r*.json")
done
for r in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    name="${v%%:*}"
    IFS=',' read -r -a sets <<<"${v#*:}"
    echo "[backward_knobs_ab] round $r: $name (${sets[*]})"
    env "${sets[@]}" "$bench" "${args[@]}" --json "$OUT/${name}_r$r.json" >"$OUT/${name}_r$r.log" 2>&1 ||
      { echo "backward_knobs_ab: $name round $r failed (see $OUT/${name}_r$r.log)" >&2; exit 1; }
  done
done
python3 bench/ab_report.py --out "$OUT/${OUT_NAME:-backward-knobs-ab}.json" --commit "${MOK_COMMIT:-unknown}" \
  --field mok_bwd_ms "${report[@]}" --what "backward_knobs_ab.sh: VARIANTS='$VARIANTS', ROUNDS=$ROUNDS, mok_bench ${args[*]}"
