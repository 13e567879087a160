#!/usr/bin/env bash
# A/B of mok_bench settings in one device call (METHOD.md: the variants alternated in one call):
# mok_bench on every visible GPU (EP = the GPU count, one rank per GPU) with each variant in turn,
# ROUNDS times, then bench/ab_report.py joins the runs by case on FIELD. A variant is
# NAME:ITEM[,ITEM...] (NAME: alone runs the defaults), each ITEM either VAR=VALUE, an environment
# knob (read when a layer is built; notes/backward.md: MOK_BWD_PULL_AHEAD and MOK_BWD_PUSH_BESIDE,
# the movement beside the GEMMs, default on at EP > 1; MOK_BWD_STREAMS, the side stream;
# MOK_BWD_HOLD, held rows), or --option=VALUE, a mok_bench option (e.g. --comm-sms=16,
# --minibatch=2048, --bwd-path=fused), or BENCH=<path>, another mok_bench for this variant (a
# build of another commit: scripts/prebuilt.sh pack-base; give only options both builds know;
# with the base build's variant first and the new one second (more may follow), BASE_COMMIT=<sha>
# makes the report's base_ms / new_ms, as runtime-ab-h200x1.json). The first variant is the reference.
#   VARIANTS="ahead_off:MOK_BWD_PULL_AHEAD=0 ahead_on:MOK_BWD_PULL_AHEAD=1" [ROUNDS=2] \
#   [MODELS=dsv3,qwen3-235b] [TOKENS=8192] [ROUTINGS=uniform] [FIELD=mok_bwd_ms] \
#   [EXTRA="--no-backward"] [BENCH=<a built mok_bench>] [MOK_COMMIT=<sha>] [OUT_NAME=knobs-ab] \
#   bench/knobs_ab.sh
# e.g. the forward's comm SMs at EP 1, alternated:
#   VARIANTS="c24:--comm-sms=24 c16:--comm-sms=16" FIELD=mok_ms EXTRA=--no-backward \
#   MODELS=qwen3-30b-a3b,qwen3-235b TOKENS=2048,8192 ROUNDS=3 bench/knobs_ab.sh
# Writes $OUT/<name>_r<round>.json per run, $OUT/$OUT_NAME.json (the joined report) and prints
# its table.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/knobs-ab-out}"
mkdir -p "$OUT"
[ -n "${VARIANTS:-}" ] || {
  echo "knobs_ab: set VARIANTS=\"NAME:ITEM[,ITEM] ...\", ITEM VAR=VALUE or --option=VALUE (the first is the reference)" >&2
  exit 2
}
ROUNDS="${ROUNDS:-2}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "knobs_ab: ROUNDS must be a positive whole number, got '$ROUNDS'" >&2; exit 2; }
[[ -z "${BENCH:-}" || -x "$BENCH" ]] || { echo "knobs_ab: BENCH '$BENCH' is not an executable file" >&2; exit 2; }
# One variant's items into sets (environment), opts (mok_bench options) and vbench (its binary,
# "" = the common one).
parse_variant() {
  local it items
  IFS=',' read -r -a items <<<"${1#*:}"
  sets=() opts=() vbench=""
  for it in "${items[@]}"; do
    if [[ -z "$it" ]]; then
      continue  # (NAME: alone: the defaults)
    elif [[ "$it" == BENCH=* ]]; then
      vbench="${it#BENCH=}"  # this variant's binary (another build: scripts/prebuilt.sh pack-base)
    elif [[ "$it" == --* ]]; then
      opts+=("${it%%=*}")
      [[ "$it" == *=* ]] && opts+=("${it#*=}")
    else
      sets+=("$it")
    fi
  done
}
for v in $VARIANTS; do
  [[ "$v" == *:* && -n "${v%%:*}" ]] || { echo "knobs_ab: variant '$v' is not NAME:ITEM[,ITEM...]" >&2; exit 2; }
  parse_variant "$v"
  [[ -z "$vbench" || -x "$vbench" ]] || { echo "knobs_ab: variant '${v%%:*}': $vbench is not an executable file" >&2; exit 2; }
done
if [[ -n "${BENCH:-}" ]]; then
  bench="$BENCH"
else
  source scripts/common.sh
  mok_ensure_deps
  mok_build --target mok_bench >"$OUT/build.log" 2>&1 || { echo "knobs_ab: build failed (see $OUT/build.log)" >&2; exit 1; }
  bench="$MOK_BUILD/bench/mok_bench"
fi
read -r -a extra <<<"${EXTRA:-}"
args=(--models "${MODELS:-dsv3,qwen3-235b}" --tokens "${TOKENS:-8192}" --routings "${ROUTINGS:-uniform}"
      --no-ablation --sustain 0 "${extra[@]}")
report=()
for v in $VARIANTS; do
  report+=(--variant "${v%%:*}=$OUT/${v%%:*}_r*.json")
done
for r in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    name="${v%%:*}"
    parse_variant "$v"
    echo "[knobs_ab] round $r: $name (${v#*:})"
    env "${sets[@]}" "${vbench:-$bench}" "${args[@]}" "${opts[@]}" --json "$OUT/${name}_r$r.json" >"$OUT/${name}_r$r.log" 2>&1 ||
      { echo "knobs_ab: $name round $r failed (see $OUT/${name}_r$r.log)" >&2; exit 1; }
  done
done
base=()
[[ -z "${BASE_COMMIT:-}" ]] || base=(--base-commit "$BASE_COMMIT")
python3 bench/ab_report.py --out "$OUT/${OUT_NAME:-knobs-ab}.json" --commit "${MOK_COMMIT:-unknown}" \
  --field "${FIELD:-mok_bwd_ms}" "${base[@]}" "${report[@]}" --what "knobs_ab.sh: VARIANTS='$VARIANTS', ROUNDS=$ROUNDS, mok_bench ${args[*]}"
