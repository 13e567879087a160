#!/usr/bin/env bash
# The reliability results in one call on a GPU machine (issue 17): builds the GPU test binaries,
# starts compute-sanitizer's four tools over the one-GPU forward (every megakernel variant, the
# unfused path), backward and reliability tests (scripts/sanitize.sh, in the background: it needs
# minutes), runs the GPU test suites meanwhile (the reliability tests with gtest's JSON), and
# assembles reliability-<gpu>x<n>.json with bench/reliability_report.py.
#   OUT                 where everything goes (default build/reliability): gtest-*.json, logs/,
#                       sanitize/ (sanitize.json and its logs), reliability-<tag>.json
#   MOK_SKIP_SANITIZE=1 tests only (the report then has no sanitizer runs)
#   MOK_SANITIZE_*      passed to scripts/sanitize.sh (tools, subset, jobs, timeout)
#   MOK_COMMIT          the commit to record (a device copy of the tree may have no .git)
# Exit status: 0 when every test passed and every sanitizer run was clean.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$MOK_ROOT/build/reliability}"
mkdir -p "$OUT/logs"
commit="${MOK_COMMIT:-$(git -C "$MOK_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export MOK_COMMIT="$commit"
mok_ensure_deps
suites=(megakernel/mok_gpu_reliability_tests megakernel/mok_gpu_layer_tests megakernel/mok_gpu_movement_tests
        schedule/mok_gpu_schedule_tests comm/mok_gpu_comm_tests gemm/mok_gpu_gemm_tests gemm/mok_gpu_gemm_primitive_tests
        mok_gpu_merge_tests)
targets=()
for s in "${suites[@]}"; do targets+=(--target "$(basename "$s")"); done
mok_build "${targets[@]}"  # a failed build stops here (set -e): never test stale binaries
set +e
san_pid=""
if [ "${MOK_SKIP_SANITIZE:-0}" != 1 ]; then
  OUT="$OUT/sanitize" MOK_SANITIZE_NO_BUILD=1 "$MOK_ROOT/scripts/sanitize.sh" >"$OUT/logs/sanitize.log" 2>&1 &
  san_pid=$!
fi
status=0
for s in "${suites[@]}"; do
  name="$(basename "$s")"
  json="$OUT/gtest-${name#mok_gpu_}.json"
  t0=$(date +%s)
  # The memory tests read the device's free memory: not while the sanitizers' processes run (below).
  "$MOK_BUILD/tests/gpu/$s" --gtest_output="json:$json" --gtest_filter=-*LayerMemory* >"$OUT/logs/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  mok_log "$name: rc $rc in $(( $(date +%s) - t0 )) s, $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/logs/$name.log" | tr '\n' ' ')"
done
sanitize_args=()
if [ -n "$san_pid" ]; then
  wait "$san_pid" || status=1
  tail -n 45 "$OUT/logs/sanitize.log" >&2
  sanitize_args=(--sanitize-json "$OUT/sanitize/sanitize.json")
fi
# The GPU to ourselves now: the layer memory tests (free memory before and after a layer).
"$MOK_BUILD/tests/gpu/megakernel/mok_gpu_layer_tests" --gtest_filter=*LayerMemory* \
  --gtest_output="json:$OUT/gtest-layer_memory.json" >"$OUT/logs/layer_memory.log" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
mok_log "layer memory tests: rc $rc, $(grep -E '^\[layer memory\]' "$OUT/logs/layer_memory.log" | tr '\n' ' ')"
tag="$(mok_gpu_tag)"
# Cases: the reliability binary's tests (the other suites' results are in their logs and gtest JSON).
python3 "$MOK_ROOT/bench/reliability_report.py" --gtest-json "$OUT/gtest-reliability_tests.json" \
  "${sanitize_args[@]}" --gpus "$(mok_gpu_count)" --commit "$commit" --out "$OUT/reliability-$tag.json" || status=1
exit $status
