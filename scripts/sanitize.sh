#!/usr/bin/env bash
# compute-sanitizer on a GPU machine: memcheck over the grouped-GEMM tests and a set of layer
# tests (1 and 2 GPUs: pull, push, ring reuse, clusters, epilogue combine, empty slots), racecheck
# over three GEMM tests (partial blocks of FC1 and FC2, split-N tiles). NCCL's own start-up
# probes raise CUDA API errors (kernels without an image for this GPU, peer access already
# enabled); they are not reported (--report-api-errors no), so
# "ERROR SUMMARY: 0 errors" means no device memory error. Instrumenting a module takes seconds
# on its first launch, so the layer tests run with a longer wait bound (MOK_TEST_WAIT_TIMEOUT_S).
# Megakernel-path layer tests only: the one unfused test tried (LayerForwardInference/unfused) ran
# over 100 s under memcheck without finishing (not diagnosed; it passes in ~1 s without the tool).
# LayerWindows.LaterLayersReuseWindows (NCCL window registration across layers) runs once mok's
# communicators are non-blocking and every NCCL host call is polled: 40 s, 0 errors (2x H200,
# 2026-11-30). It hung for 300 s under memcheck when those calls were blocking.
# The backward (eighth session; added, not yet run under the tool): the FFN chain (every backward
# form, the unpacked wgrad epilogue) and the layer's backward at EP 1 and 2 on the megakernel path
# (its kernels are the unfused backward's: reverse-combine pull, push, router-weight gradient).
# Logs: $OUT (default build/sanitize). Exit status: 0 when every run is clean.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$MOK_ROOT/build/sanitize}"
mkdir -p "$OUT"
mok_ensure_deps
# A failed build stops here (common.sh's set -e): never sanitize stale binaries.
mok_build --target mok_gpu_gemm_tests --target mok_gpu_layer_tests
set +e  # from here every run is judged from its log, and all of them run
cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
[ -x "$cs" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
gemm="$MOK_BUILD/tests/gpu/gemm/mok_gpu_gemm_tests"
layer="$MOK_BUILD/tests/gpu/megakernel/mok_gpu_layer_tests"
gemm_tests='GroupedGemm.Fc1SwiGLUSmallExpertsPartialBlocks:GroupedGemm.Fc2SmallExpertsPartialBlocks:GroupedGemm.SplitNForNearlyEmptyTiles:GroupedGemm.WgradKGroupedMaskedPadding:GroupedGemm.DgradMNMajorWeights:GroupedGemm.ClustersMulticastB:FfnBackward.FormsComposeIntoTheSpecifiedBackward'
layer_tests='Routings/LayerForward.*/ep1_uniform_shared:Routings/LayerForward.*/ep2_zipf:Routings/LayerForward.*/ep2_empty_slots_t0_shared:Ring/LayerForward.*/ring_mb128_macro256:PushDispatch/LayerForward.*/ep2_zipf:Clusters/LayerForward.*/ep2_zipf:EpilogueCombine/LayerForward.*/ep2_zipf:Paths/LayerForwardInference.*/megakernel:LayerWindows.LaterLayersReuseWindows:Routings/LayerBackward.*/ep1_uniform_shared:Routings/LayerBackward.*/ep2_zipf'
status=0
run() {  # name tool binary filter
  local log="$OUT/$1.log"
  MOK_TEST_WAIT_TIMEOUT_S=120 timeout 900 "$cs" --tool "$2" --report-api-errors no --print-limit 100 \
    "$3" --gtest_filter="$4" >"$log" 2>&1
  local rc=$?
  local summary
  summary="$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 || true)"
  local passed failed
  passed="$(grep -c '^\[       OK \]' "$log" || true)"
  failed="$(grep -c '^\[  FAILED  \] .*\.' "$log" || true)"
  mok_log "$1: rc $rc, $passed tests passed, $failed failed; ${summary:-no summary} ($log)"
  # Clean: exit 0, at least one test ran, none failed, and a zero summary (anchored: "10 hazards"
  # must not match "0 hazards").
  if [ "$rc" -ne 0 ] || [ "$passed" -eq 0 ] || [ "$failed" -ne 0 ] ||
     ! grep -qE "(ERROR SUMMARY: 0 errors|SUMMARY: 0 hazards displayed \(0 errors)" <<<"$summary"; then
    status=1
  fi
}
run memcheck-gemm memcheck "$gemm" "$gemm_tests"
run memcheck-layer memcheck "$layer" "$layer_tests"
run racecheck-gemm racecheck "$gemm" 'GroupedGemm.Fc1SwiGLUSmallExpertsPartialBlocks:GroupedGemm.Fc2SmallExpertsPartialBlocks:GroupedGemm.SplitNForNearlyEmptyTiles'
exit $status
