#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MOK_COMMIT=3834006
B=build/device/bench/mok_bench
LT=build/device/tests/gpu/megakernel/mok_gpu_layer_tests
for s in 0 1 2 3; do
  echo "== skew $s"
  MOK_MK_SKEW=$s timeout 60 $B --models qwen3-30b-a3b,qwen3-235b --tokens 2048,8192 --routings uniform --no-ablation --sustain 0 2>&1 | grep -E "^\| (qwen|dsv3)"
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer)
t1=$(date +%s)
timeout 240 $CS --tool memcheck --print-limit 20 $LT --gtest_filter='Routings/LayerForward.*/ep2_zipf:Routings/LayerForward.*/ep2_empty_slots_t0_shared:Ring/LayerForward.*/ring_mb128_macro256:PushDispatch/LayerForward.*/ep2_zipf:Clusters/LayerForward.*/ep2_zipf:EpilogueCombine/LayerForward.*/ep2_zipf' > $OUT/memcheck-layer.log 2>&1
echo "== memcheck layer rc=$? $(( $(date +%s) - t1 )) s"; grep -E "ERROR SUMMARY|OK \]|FAILED|Invalid|rror" $OUT/memcheck-layer.log | head -30
