#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MOK_COMMIT=$(cat .commit)
export MOK_GTEST_SOURCE=$PWD/.deps/googletest MOK_BUILD=$PWD/build/device
t0=$(date +%s)
(source scripts/common.sh && mok_ensure_deps && timeout 170 bash -c 'source scripts/common.sh; mok_build --target mok_bench --target mok_gpu_layer_tests -- -k 0') > $OUT/build.log 2>&1
echo "build $(( $(date +%s) - t0 )) s"; grep -E "error|FAILED" $OUT/build.log | head
LT=build/device/tests/gpu/megakernel/mok_gpu_layer_tests
timeout 60 $LT --gtest_filter='*LayerForwardInference*:Routings/LayerForward.*/ep2_zipf:Dispatch/LayerForwardGraph*' 2>&1 | grep -E "OK \]|FAILED|PASSED|Failure|Expected|rank" | head -20
timeout 100 build/device/bench/mok_bench --models qwen3-30b-a3b,dsv3 --tokens 8192 --routings uniform --sustain 0 2>&1 | grep -E "^\| (qwen|dsv3).*(megakernel \||inference|unfused)"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer)
timeout 80 $CS --tool memcheck --report-api-errors no --print-limit 50 $LT --gtest_filter='Routings/LayerForward.*/ep2_zipf:Routings/LayerForward.*/ep2_empty_slots_t0_shared:Ring/LayerForward.*/ring_mb128_macro256:PushDispatch/LayerForward.*/ep2_zipf:Clusters/LayerForward.*/ep2_zipf:EpilogueCombine/LayerForward.*/ep2_zipf' > $OUT/mc.log 2>&1
echo "memcheck rc=$?"; grep -E "OK \]|FAILED|ERROR SUMMARY|Invalid" $OUT/mc.log | head -12
