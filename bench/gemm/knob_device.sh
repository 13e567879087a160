#!/usr/bin/env bash
# The device call of a GEMM knob that keeps the bits (gemm::Options field with a mok_gemm_bench
# option and a layer environment knob): its GPU tests, the GEMM A/B (one binary, the option 0/1
# alternated), the layer A/B (the knob 0/1 alternated), and optionally ncu's DRAM bytes of one
# backward's kernels with the knob off and on. Here first: scripts/prebuilt.sh pack mok_bench
# mok_gemm_bench mok_gpu_gemm_tests [mok_gpu_layer_tests]; then run it with carry ["devrun"].
#   KNOB=group_experts|tile_handoff   which one (sets the option, the env knob and the defaults below;
#                                     tile_handoff: notes/experiments/wgrad-tile-handoff.patch applied)
#   GEMM_FILTER, ROWS                 the GEMM cases (mok_gemm_bench --filter / --rows)
#   TESTS                             the GEMM tests' gtest filter; LAYER_TESTS: the layer tests' (run
#                                     with the knob on; needs mok_gpu_layer_tests)
#   MODELS, ROUNDS                    the layer A/B (default dsv3,qwen3-235b; 2 rounds)
#   LIMIT                             the seconds the call may take (600); NCU_S: kept for ncu (0: none)
#   KEEP_LOOSE                        1: leave every log and JSON loose in $OUT (else logs.tgz + 2 summaries)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
source scripts/prebuilt.sh env
case "${KNOB:-}" in
  group_experts) opt=--group-experts env=MOK_GROUP_EXPERTS
    tests=${TESTS:-GroupedGemm.ExpertSplitRasterGroups:GroupedGemm.DgradSwiGLUExpertSplitRaster} filter=${GEMM_FILTER:-dsv3-dgrad} rows=${ROWS:-256,260,2048} ;;
  tile_handoff) opt=--tile-handoff env=MOK_TILE_HANDOFF
    tests=${TESTS:-GroupedGemm.WgradTileHandoff:GroupedGemm.Wgrad*} filter=${GEMM_FILTER:-dsv3-wgrad-fc}
    rows=${ROWS:-128,256,260,512,2048} ;;
  *) echo "knob_device: KNOB=group_experts or tile_handoff, got '${KNOB:-}'" >&2; exit 2 ;;
esac
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null; }
mkdir -p "$OUT/l"
nvidia-smi --query-gpu=name --format=csv,noheader; cat devrun/commit; echo "knob $KNOB ($opt, $env)"
timeout 120 devrun/bin/mok_gpu_gemm_tests --gtest_filter="$tests" >"$OUT/l/gemm-tests.log" 2>&1; echo "gemm tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/l/gemm-tests.log" | head -5
if [ -n "${LAYER_TESTS:-}" ] && [ -x devrun/bin/mok_gpu_layer_tests ]; then
  env "$env=1" timeout 240 devrun/bin/mok_gpu_layer_tests --gtest_filter="$LAYER_TESTS" >"$OUT/l/layer-tests.log" 2>&1
  echo "layer tests ($env=1) rc=$?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/l/layer-tests.log" | head -5
fi
pack
el "gemm ab"
OUT="$OUT/gab" BENCH=devrun/bin/mok_gemm_bench BASE_ARGS="$opt 0" NEW_ARGS="$opt 1" FILTER="$filter" \
  BENCH_ARGS="--reps 20 --rows $rows" ROUNDS=${ROUNDS:-2} timeout 120 bench/gemm/ab_device.sh >"$OUT/l/gemm-ab.log" 2>&1; echo "rc=$?"
tail -14 "$OUT/l/gemm-ab.log"
pack
el "layer ab"
OUT="$OUT/lab" BENCH=devrun/bin/mok_bench MOK_COMMIT="$(head -1 devrun/commit)" \
  VARIANTS="off:$env=0 on:$env=1" FIELD=mok_bwd_ms MODELS=${MODELS:-dsv3,qwen3-235b} \
  TOKENS=8192 ROUNDS=${ROUNDS:-2} OUT_NAME="$KNOB-layer-ab" timeout $(( ${LIMIT:-600} - 12 - ${NCU_S:-0} - ($(date +%s) - T0) )) \
  bench/knobs_ab.sh >"$OUT/l/layer-ab.log" 2>&1; echo "rc=$?"
tail -5 "$OUT/l/layer-ab.log"
pack
if [ "${NCU_S:-0}" -gt 0 ]; then
  el "ncu: one backward's kernels, DRAM bytes, $env off and on"
  for v in 0 1; do
    env "$env=$v" timeout $(( NCU_S / 2 )) ncu --clock-control none --launch-count 700 --csv --page raw --print-units base \
      --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_write.sum,dram__bytes_read.sum,launch__grid_size \
      devrun/bin/mok_bench --models dsv3 --tokens 8192 --routings uniform --no-ablation --sustain 0 --warmup 1 --iters 20 \
      --json "$OUT/l/ncu_bench_$v.json" >"$OUT/l/ncu_$v.csv" 2>&1; echo "rc=$?"
    python3 bench/ncu_kernels.py "$OUT/l/ncu_$v.csv" --start backward_routing_kernel --json "$OUT/l/ncu_$v.json" | grep -i "gemm\|total"
    pack
  done
fi
el done
# The device call brings back a limited number of files: everything is in logs.tgz, so only it and
# the two A/B summaries stay loose (KEEP_LOOSE=1 keeps all).
if [ -z "${KEEP_LOOSE:-}" ]; then
  cp "$OUT/gab/gemm-ab.json" "$OUT/$KNOB-gemm-ab.json" 2>/dev/null
  cp "$OUT/lab/$KNOB-layer-ab.json" "$OUT/" 2>/dev/null
  rm -rf "$OUT/l" "$OUT/gab" "$OUT/lab"
fi
