#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MOK_COMMIT=3834006
export MOK_GTEST_SOURCE=$PWD/.deps/googletest MOK_BUILD=$PWD/build/device
t0=$(date +%s)
(source scripts/common.sh && mok_ensure_deps && mok_build --target mok_bench --target mok_gpu_gemm_tests --target mok_gpu_layer_tests -- -k 0) > $OUT/build.log 2>&1
echo "build $(( $(date +%s) - t0 )) s"; grep -E "error|FAILED" $OUT/build.log | head
B=build/device/bench/mok_bench
GT=build/device/tests/gpu/gemm/mok_gpu_gemm_tests
LT=build/device/tests/gpu/megakernel/mok_gpu_layer_tests
for m in "dsv3 2048" "qwen3-30b-a3b 8192" "dsv3 8192"; do
  set -- $m
  MOK_PROFILE=1 timeout 60 $B --models $1 --tokens $2 --routings uniform --no-ablation --sustain 0 > $OUT/prof-$1-$2.log 2>&1
  echo "== profile $1 $2 rc=$?"; grep -vE "^\[mok\] (building|configuring)" $OUT/prof-$1-$2.log | tail -25
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer)
t1=$(date +%s)
timeout 150 $CS --tool memcheck --print-limit 20 $GT --gtest_filter='GroupedGemm.Fc1SwiGLUSmallExpertsPartialBlocks:GroupedGemm.Fc2SmallExpertsPartialBlocks:GroupedGemm.SplitNForNearlyEmptyTiles:GroupedGemm.WgradKGroupedMaskedPadding:GroupedGemm.DgradMNMajorWeights:GroupedGemm.ClustersMulticastB' > $OUT/memcheck-gemm.log 2>&1
echo "== memcheck gemm rc=$? $(( $(date +%s) - t1 )) s"; grep -E "ERROR SUMMARY|OK \]|FAILED|Invalid|error" $OUT/memcheck-gemm.log | head -20
t1=$(date +%s)
timeout 200 $CS --tool memcheck --print-limit 20 $LT --gtest_filter='Routings/LayerForward.ep2_zipf:Routings/LayerForward.ep2_empty_slots_t0_shared:Ring/LayerForward.ring_mb128_macro256:PushDispatch/LayerForward.ep2_zipf:Clusters/LayerForward.ep2_zipf:EpilogueCombine/LayerForward.ep2_zipf' > $OUT/memcheck-layer.log 2>&1
echo "== memcheck layer rc=$? $(( $(date +%s) - t1 )) s"; grep -E "ERROR SUMMARY|OK \]|FAILED|Invalid|error" $OUT/memcheck-layer.log | head -20
t1=$(date +%s)
timeout 90 $CS --tool racecheck --print-limit 10 $GT --gtest_filter='GroupedGemm.Fc1SwiGLUSmallExpertsPartialBlocks:GroupedGemm.Fc2SmallExpertsPartialBlocks' > $OUT/racecheck-gemm.log 2>&1
echo "== racecheck gemm rc=$? $(( $(date +%s) - t1 )) s"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|OK \]|FAILED|hazard" $OUT/racecheck-gemm.log | head -10
