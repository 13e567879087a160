#!/usr/bin/env bash
# The device call for gemm::Options::group_experts (notes/backward.md, "raster groups split at experts"):
# the GPU test, the GEMM A/B (one binary, --group-experts 0/1 alternated), the layer backward A/B
# (MOK_GROUP_EXPERTS 0/1 alternated). Here first: scripts/prebuilt.sh pack mok_bench mok_gemm_bench
# mok_gpu_gemm_tests; then run it with carry ["devrun"]. LIMIT: the seconds the call may take (600);
# NCU_S: the seconds kept for the last step, ncu's DRAM bytes of the backward's kernels (300; 0 skips it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
source scripts/prebuilt.sh env
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null; }
mkdir -p "$OUT/l"
nvidia-smi --query-gpu=name --format=csv,noheader; cat devrun/commit
timeout 40 devrun/bin/mok_gpu_gemm_tests --gtest_filter='GroupedGemm.ExpertSplitRasterGroups' >"$OUT/l/test.log" 2>&1; echo "test rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/l/test.log" | head -5
el "gemm ab"
OUT="$OUT/gab" BENCH=devrun/bin/mok_gemm_bench BASE_ARGS="--group-experts 0" NEW_ARGS="--group-experts 1" FILTER=dsv3-dgrad \
  BENCH_ARGS="--reps 20 --rows 256,260,2048" ROUNDS=${ROUNDS:-2} timeout 90 bench/gemm/ab_device.sh >"$OUT/l/gemm-ab.log" 2>&1; echo "rc=$?"
tail -12 "$OUT/l/gemm-ab.log"
pack
el "layer ab"
OUT="$OUT/lab" BENCH=devrun/bin/mok_bench MOK_COMMIT="$(head -1 devrun/commit)" \
  VARIANTS="off:MOK_GROUP_EXPERTS=0 on:MOK_GROUP_EXPERTS=1" FIELD=mok_bwd_ms MODELS=${MODELS:-dsv3,qwen3-235b} \
  TOKENS=8192 ROUNDS=${ROUNDS:-2} OUT_NAME=group-experts-layer-ab timeout $(( ${LIMIT:-600} - 12 - ${NCU_S:-300} - ($(date +%s) - T0) )) bench/knobs_ab.sh \
  >"$OUT/l/layer-ab.log" 2>&1; echo "rc=$?"
tail -4 "$OUT/l/layer-ab.log"
pack
el "ncu: the backward's kernels, DRAM bytes, knob off and on"
[ "${NCU_S:-300}" -gt 0 ] && for v in 0 1; do
  MOK_GROUP_EXPERTS=$v timeout 150 ncu --clock-control none --launch-count 700 --csv --page raw --print-units base \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_write.sum,dram__bytes_read.sum,launch__grid_size \
    devrun/bin/mok_bench --models dsv3 --tokens 8192 --routings uniform --no-ablation --sustain 0 --warmup 1 --iters 20 \
    --json "$OUT/l/ncu_bench_$v.json" >"$OUT/l/ncu_$v.csv" 2>&1; echo "rc=$?"
  python3 bench/ncu_kernels.py "$OUT/l/ncu_$v.csv" --start backward_routing_kernel --json "$OUT/l/ncu_$v.json" | grep -i "gemm\\|total"
  pack
done
el done
