#!/usr/bin/env bash
# One device call on a machine with several GPUs (the 2-GPU and 8-GPU issues), from prebuilt
# binaries: `scripts/prebuilt.sh pack` here, then run `scripts/ep_device.sh` there with the call's
# carry ["devrun"]. Multi-GPU machines come rarely and each call has a wall-clock limit, so the
# steps go most important first and each is bounded by what is left of EP_BUDGET_S, leaving time
# to pack the logs:
#   env      GPUs, topology, the prebuilt commit
#   tests    the prebuilt GPU test binaries with multi-GPU cases (EP_TESTS, default the layer and
#            reliability suites; the others have one-GPU cases only)
#   python   the package's EP tests (tests/python/test_moe_ep.py: one process per GPU) and its
#            other GPU tests
#   main     the main job: scripts/run.sh with MOK_BENCH (mok_bench on every GPU, the PyTorch+NCCL
#            baseline, the report -> forward-<gpu>x<n>.json); EP_MAIN_ARGS, default
#            "--tokens 8192 --routings uniform --no-ablation" (MOK_FP8=0 unless set: the FP8 passes
#            double it)
#   knobs    the backward's movement beside the GEMMs at EP > 1, alternated (bench/knobs_ab.sh:
#            MOK_BWD_PULL_AHEAD, MOK_BWD_PUSH_BESIDE off vs the default on; and the x rows pulled by
#            FC2's dgrad's idle producer warps, MOK_BWD_X_BESIDE=1, instead of ahead on 16 SMs),
#            DeepSeek-V3 and Qwen3-235B at T 8192
#   windows  the price of the backward's windows past the routed rows (most of them at EP 8:
#            notes/memory.md), MOK_BWD_SYNC_WINDOWS=2 (a host wait, every window) against =1 (the
#            same wait, only the windows up to the routed rows), DeepSeek-V3 at T 8192
# Environment: OUT (default /tmp/ep-device-out; the device sets it), EP_STEPS (default
# "env tests python main knobs windows"), EP_BUDGET_S (default 560 s for all of it), EP_STEP_MAX_S (default
# 240 s: no step takes all that is left), EP_DRY_RUN=1 (print each step's command and run nothing:
# checked by ctest device_scripts).
# Writes $OUT/summary.txt (one line per step: exit status, seconds, the tests' tallies), the JSON
# results under $OUT/results/ and everything else in $OUT/logs.tgz. Exit status 1 when a step
# failed or timed out, 2 on a bad setting.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/ep-device-out}"
LOGS="$OUT/logs"
mkdir -p "$LOGS" "$OUT/results"
budget="${EP_BUDGET_S:-560}"
[[ "$budget" =~ ^[1-9][0-9]*$ ]] || { echo "ep_device: EP_BUDGET_S must be a positive whole number, got '$budget'" >&2; exit 2; }
step_max="${EP_STEP_MAX_S:-240}"
[[ "$step_max" =~ ^[1-9][0-9]*$ ]] || { echo "ep_device: EP_STEP_MAX_S must be a positive whole number, got '$step_max'" >&2; exit 2; }
steps="${EP_STEPS:-env tests python main knobs windows}"
for s in $steps; do
  case "$s" in env|tests|python|main|knobs|windows) ;;
    *) echo "ep_device: unknown step '$s' in EP_STEPS (env tests python main knobs windows)" >&2; exit 2 ;;
  esac
done
dry="${EP_DRY_RUN:-0}"
if [ "$dry" != 1 ]; then
  [ -d devrun/bin ] || { echo "ep_device: no devrun/bin: run scripts/prebuilt.sh pack and carry devrun" >&2; exit 2; }
  # shellcheck source=scripts/prebuilt.sh
  source scripts/prebuilt.sh env
fi
start=$SECONDS
summary="$OUT/summary.txt"
: >"$summary"
failed=0

# step NAME CMD...: CMD bounded by EP_STEP_MAX_S and by what is left (keeping 20 s to pack), its
# output in logs/NAME.log, a summary line. A step with less than 30 s left is skipped, and says so.
step() {
  local name="$1" left rc t0
  shift
  left=$((budget - 20 - (SECONDS - start)))
  if [ "$dry" = 1 ]; then
    printf '%s:' "$name" >>"$summary"
    printf ' %q' "$@" >>"$summary"
    printf '\n' >>"$summary"
    return 0
  fi
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped (${left}s left of ${budget}s)" | tee -a "$summary"
    return 0
  fi
  [ "$left" -le "$step_max" ] || left="$step_max"
  t0=$SECONDS
  timeout -k 10 "$left" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=1
  local tally late=""
  # gtest's closing tallies, or pytest's last line ("3 passed, 1 skipped in 9.1s", "no tests ran").
  tally="$(grep -hE '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$LOGS/$name.log" | tr -s ' ' | tr '\n' ' ')"
  [ -n "$tally" ] || tally="$(grep -hE '(passed|failed|skipped|error|no tests ran)' "$LOGS/$name.log" | tail -1)"
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && late=" (timed out after ${left} s)"
  echo "$name: exit $rc$late, $((SECONDS - t0)) s. $tally" | tee -a "$summary"
}

for s in $steps; do
  case "$s" in
    env)
      step env bash -c 'nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm,power.limit --format=csv;
        nvidia-smi topo -m; cat devrun/commit 2>/dev/null; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())"' ;;
    tests)
      for b in ${EP_TESTS:-mok_gpu_layer_tests mok_gpu_reliability_tests}; do
        step "$b" "devrun/bin/$b"
      done ;;
    python)
      step python_ep python3 -m pytest -q tests/python/test_moe_ep.py
      step python_gpu python3 -m pytest -q tests/python/test_moe_gpu.py ;;
    main)
      read -r -a main_args <<<"${EP_MAIN_ARGS:---tokens 8192 --routings uniform --no-ablation}"
      step main env MOK_BENCH=devrun/bin/mok_bench MOK_OUT="$OUT/results" MOK_FP8="${MOK_FP8:-0}" \
        bash scripts/run.sh "${main_args[@]}" ;;
    knobs)
      step knobs env BENCH=devrun/bin/mok_bench OUT="$LOGS/knobs" OUT_NAME=bwd-movement-ab FIELD=mok_bwd_ms \
        VARIANTS="default: ahead_off:MOK_BWD_PULL_AHEAD=0 beside_off:MOK_BWD_PUSH_BESIDE=0 x_in_d2:MOK_BWD_PULL_AHEAD=0,MOK_BWD_X_BESIDE=1" \
        MODELS=dsv3,qwen3-235b TOKENS=8192 ROUNDS=2 bash bench/knobs_ab.sh
      [ "$dry" = 1 ] || cp "$LOGS/knobs/bwd-movement-ab.json" "$OUT/results/" ||
        echo "knobs: no joined report (see logs/knobs.log)" | tee -a "$summary" ;;
    windows)
      step windows env BENCH=devrun/bin/mok_bench OUT="$LOGS/windows" OUT_NAME=bwd-empty-windows-ab FIELD=mok_bwd_ms \
        VARIANTS="wait:MOK_BWD_SYNC_WINDOWS=2 skip:MOK_BWD_SYNC_WINDOWS=1" MODELS=dsv3 TOKENS=8192 ROUNDS=2 \
        bash bench/knobs_ab.sh
      [ "$dry" = 1 ] || cp "$LOGS/windows/bwd-empty-windows-ab.json" "$OUT/results/" ||
        echo "windows: no joined report (see logs/windows.log)" | tee -a "$summary" ;;
  esac
done
if [ "$dry" != 1 ]; then
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  echo "ep_device: $((SECONDS - start)) s; summary $summary, results $OUT/results, logs $OUT/logs.tgz"
fi
cat "$summary"
exit "$failed"
