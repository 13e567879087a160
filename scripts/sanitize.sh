#!/usr/bin/env bash
# compute-sanitizer on a one-GPU machine: memcheck, racecheck, synccheck and initcheck over the
# one-GPU tests of every forward megakernel variant (pull, ring, clusters, push dispatch, epilogue
# combine), the unfused forward, the backward (unfused, and after the megakernel forward) and the
# reliability tests (bad routing, bad pointers); memcheck and racecheck over the grouped-GEMM tests
# (bf16 and FP8, forward and backward forms).
# One process per (tool, test): a hang or a crash costs one run, not the rest, and each run has its
# own log and verdict. Two-GPU tests (EP 2, window reuse across layers) are not run here.
#
# Why the flags: NCCL's own start-up probes raise CUDA API errors (kernels without an image for
# this GPU, peer access already enabled); they are not reported (--report-api-errors no), so
# "ERROR SUMMARY: 0 errors" means no device-side error. Instrumenting a module takes seconds on
# its first launch, so the tests' wait bound is raised (MOK_TEST_WAIT_TIMEOUT_S=120), and each run
# has a wall-clock bound (the unfused forward once ran past 100 s under memcheck).
#
# Environment:
#   OUT                     logs and sanitize.json (default build/sanitize); logs are <tool>-<test>.log
#   MOK_SANITIZE_TOOLS      tools to run (default "memcheck racecheck synccheck initcheck")
#   MOK_SANITIZE_ONLY       extended regex on the test label (e.g. '^fwd_'), to run a subset
#   MOK_SANITIZE_JOBS       runs at once (default 4): the tests use one GPU and several processes
#                           share it by time slicing, so concurrency only trades speed per run
#   MOK_SANITIZE_TIMEOUT_S  wall-clock bound per run (default 240); a timeout is a failure
#   MOK_SANITIZE_DRY_RUN=1  print the commands, build and run nothing, write sanitize.json with
#                           null results (for checking the selection without a GPU)
#   MOK_SANITIZE_BIN_DIR    take the test binaries from this folder (prebuilt: devrun/bin,
#                           scripts/prebuilt.sh), build nothing
#   MOK_SANITIZE_NO_BUILD=1 use the binaries already built (a second pass over one build; the CPU
#                           test's stub runs); a missing binary fails its runs
#   MOK_COMMIT              commit recorded in sanitize.json (default: git rev-parse HEAD)
# `sanitize.sh --judge TOOL LOG RC` prints the verdict of one log (the CPU test uses it).
# Exit status: 0 when every run is clean; 1 when one is not; 2 on a usage or setup error.
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# --- Judging one log --------------------------------------------------------------------------
# Prints "errors<TAB>passed<TAB>failed<TAB>clean". errors is the summary's error count, or -1 when
# there is no summary (a timeout, a crash, a missing binary). Clean: exit status 0, at least one
# test passed (a filter that matches nothing, or tests that all skip, prove nothing), none failed,
# and a zero summary (for racecheck: no hazard at all, warnings included).
mok_sanitize_judge() {  # tool log rc
  local tool="$1" log="$2" rc="$3" summary counts errors=-1 hazards=-1 warnings=-1 passed failed
  local clean=false
  if [ "$tool" = racecheck ]; then
    summary="$(grep -E 'RACECHECK SUMMARY:' "$log" 2>/dev/null | tail -1 || true)"
    # "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)"; singular forms too.
    counts="$(sed -nE 's/.*RACECHECK SUMMARY: ([0-9]+) hazards? displayed \(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 \2 \3/p' <<<"$summary")"
    [ -n "$counts" ] && read -r hazards errors warnings <<<"$counts"
  else
    summary="$(grep -E 'ERROR SUMMARY:' "$log" 2>/dev/null | tail -1 || true)"
    counts="$(sed -nE 's/.*ERROR SUMMARY: ([0-9]+) errors?.*/\1/p' <<<"$summary")"
    [ -n "$counts" ] && errors="$counts" && hazards=0 && warnings=0
  fi
  # timeout(1): 124 when the run was stopped by SIGTERM, 137 when it needed the SIGKILL. Whatever
  # summary a stopped run left is not a verdict.
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then errors=-1; fi
  passed="$(grep -c '^\[       OK \] ' "$log" 2>/dev/null || true)"
  # gtest prints a failed test's name twice (when it ends, and in the final list): count names.
  failed="$(grep -E '^\[  FAILED  \] [^ ,]+\.[^ ,]+' "$log" 2>/dev/null |
            sed -E 's/^\[  FAILED  \] ([^ ,]+).*/\1/' | sort -u | wc -l || true)"
  passed="${passed:-0}" failed="${failed// /}"
  if [ "$rc" = 0 ] && [ "$passed" -gt 0 ] && [ "${failed:-0}" -eq 0 ] && [ "$errors" -eq 0 ] &&
     [ "$hazards" -eq 0 ] && [ "$warnings" -eq 0 ]; then
    clean=true
  fi
  printf '%s\t%s\t%s\t%s\n' "$errors" "$passed" "${failed:-0}" "$clean"
}

if [ "${1:-}" = --judge ]; then
  [ $# -eq 4 ] || { echo "usage: $0 --judge TOOL LOG RC" >&2; exit 2; }
  mok_sanitize_judge "$2" "$3" "$4"
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0   (settings through the environment; see the header)" >&2; exit 2; }

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$MOK_ROOT/build/sanitize}"
tools="${MOK_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
only="${MOK_SANITIZE_ONLY:-}"
max_jobs="${MOK_SANITIZE_JOBS:-4}"
timeout_s="${MOK_SANITIZE_TIMEOUT_S:-240}"
dry_run="${MOK_SANITIZE_DRY_RUN:-0}"
no_build="${MOK_SANITIZE_NO_BUILD:-0}"
[[ "$max_jobs" =~ ^[1-9][0-9]*$ ]] || { mok_log "MOK_SANITIZE_JOBS must be a positive integer"; exit 2; }
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || { mok_log "MOK_SANITIZE_TIMEOUT_S must be a positive integer"; exit 2; }
for t in $tools; do
  case "$t" in memcheck|racecheck|synccheck|initcheck) ;;
    *) mok_log "unknown tool in MOK_SANITIZE_TOOLS: $t"; exit 2 ;; esac
done

# --- What runs ----------------------------------------------------------------------------------
# Binaries by key: target name and path. The reliability binary may not be defined yet in a
# checkout; its runs then fail as "binary not found" instead of stopping the others.
declare -A target_of=([layer]=mok_gpu_layer_tests [gemm]=mok_gpu_gemm_tests
                      [primitives]=mok_gpu_gemm_primitive_tests [reliability]=mok_gpu_reliability_tests)
declare -A path_of=([layer]="$MOK_BUILD/tests/gpu/megakernel/mok_gpu_layer_tests"
                    [gemm]="$MOK_BUILD/tests/gpu/gemm/mok_gpu_gemm_tests"
                    [primitives]="$MOK_BUILD/tests/gpu/gemm/mok_gpu_gemm_primitive_tests"
                    [reliability]="$MOK_BUILD/tests/gpu/megakernel/mok_gpu_reliability_tests")
if [ -n "${MOK_SANITIZE_BIN_DIR:-}" ]; then
  for k in "${!target_of[@]}"; do path_of[$k]="$MOK_SANITIZE_BIN_DIR/${target_of[$k]}"; done
  no_build=1
fi
gemm_tests='WgradCarry.*:DgradSwiGLURouter.*:GroupedGemm.Fc1SwiGLUSmallExpertsPartialBlocks:GroupedGemm.Fc2SmallExpertsPartialBlocks:GroupedGemm.SplitNForNearlyEmptyTiles:GroupedGemm.WgradKGroupedMaskedPadding:GroupedGemm.DgradMNMajorWeights:GroupedGemm.ClustersMulticastB:FfnBackward.FormsComposeIntoTheSpecifiedBackward'
all_tools="memcheck racecheck synccheck initcheck"
# label | binary key | gtest filter | tools it is run under
specs=(
  "fwd_megakernel_pull|layer|Routings/LayerForward.*/ep1_uniform_shared|$all_tools"
  "fwd_megakernel_ring|layer|Ring/LayerForward.*/ring_ep1_mb128_macro256|$all_tools"
  "fwd_megakernel_clusters|layer|Clusters/LayerForward.*/ep1_uniform_shared|$all_tools"
  "fwd_megakernel_push|layer|PushDispatch/LayerForward.*/ep1_uniform_shared|$all_tools"
  "fwd_megakernel_epilogue_combine|layer|EpilogueCombine/LayerForward.*/ep1_uniform_shared|$all_tools"
  "fwd_unfused|layer|Routings/LayerForward.*/ep1_uniform_shared_unfused|$all_tools"
  "fwd_fp8|layer|Routings/LayerFp8.*/zipf|$all_tools"
  "bwd_unfused|layer|Routings/LayerBackward.*/ep1_uniform_shared_unfused|$all_tools"
  "bwd_after_megakernel|layer|Routings/LayerBackward.*/ep1_uniform_shared|$all_tools"
  # The backward over windows of a small ring, a budget cutting a window (saved rows and FC1
  # recomputed), and several forwards alive (slots swapped, reused, refused).
  # racecheck over the Zipf case (and its unfused reference) held 122 GB of host memory after
  # 43 s and was killed by the kernel's OOM killer on the 128 GB H200 machine (rc 9, twice): it
  # runs the uniform case of the same ring and budget.
  "bwd_windows|layer|Rings/LayerBackwardWindows.*/zipf_ring384_part|memcheck synccheck initcheck"
  "bwd_windows_uniform|layer|Rings/LayerBackwardWindows.*/uniform_ring256_part|racecheck"
  "bwd_saved_forwards|layer|Budgets/LayerSavedForwards.*/part|$all_tools"
  # The backward's GEMM program (Config::backward_path fused) over windows, every ticket order.
  "bwd_program|layer|Backwards/LayerBackwardProgram.*/windows_uniform_saved|$all_tools"
  "reliability|reliability|Paths/BadRouting.*:BadRoutingBackward.*:Faults/BadPointers.*|$all_tools"
  # The GEMM tests' edge shapes (partial blocks, split-N, masked wgrad padding) under memcheck and
  # racecheck, as before; the layer runs the grouped-GEMM kernels under all four tools anyway.
  "gemm|gemm|$gemm_tests|memcheck racecheck"
  # FP8: the block-scaled grouped forms and the quantization kernels (not the 2^32-input
  # conversion check, which is a plain loop and would take hours under a tool).
  "fp8_gemm|gemm|Fp8Grouped.*|memcheck racecheck"
  # The FP8 backward's forms: the K-grouped wgrad (per-stage scales bulk-copied by the producer)
  # and the dgrads (+ SwiGLU', packed FC1 weight codes).
  "fp8_backward|gemm|Fp8Wgrad.*:Fp8Dgrad.*|memcheck racecheck"
  "fp8_quantize|primitives|Fp8Quantize.*|memcheck racecheck initcheck"
)
# The runs, test-major with the tools in MOK_SANITIZE_TOOLS order: the results' order is this
# order whatever order the runs finish in, and neighbours (which run at the same time) are mostly
# different tools over one binary.
run_tool=() run_test=() run_key=() run_filter=()
declare -A needed=()
for spec in "${specs[@]}"; do
  IFS='|' read -r label key filter spec_tools <<<"$spec"
  if [ -n "$only" ] && ! [[ "$label" =~ $only ]]; then continue; fi
  for t in $tools; do
    [[ " $spec_tools " == *" $t "* ]] || continue
    run_tool+=("$t") run_test+=("$label") run_key+=("$key") run_filter+=("$filter")
    needed[$key]=1
  done
done
[ ${#run_tool[@]} -gt 0 ] || { mok_log "no run selected (MOK_SANITIZE_TOOLS='$tools', MOK_SANITIZE_ONLY='$only')"; exit 2; }
mkdir -p "$OUT"

# --- Build (only the binaries the selected runs use) --------------------------------------------
cs=compute-sanitizer
if [ "$dry_run" = 1 ]; then
  mok_log "dry run: would build $(for k in $(printf '%s\n' "${!needed[@]}" | sort); do printf '%s ' "${target_of[$k]}"; done)"
elif [ "$no_build" = 1 ]; then
  mok_log "no build: running the binaries found under ${MOK_SANITIZE_BIN_DIR:-$MOK_BUILD}"
else
  mok_ensure_deps
  # Configures when needed and regenerates a stale build.ninja, so that the query below sees the
  # targets the current CMakeLists define.
  mok_build --target build.ninja
  targets=()
  for k in $(printf '%s\n' "${!needed[@]}" | sort); do
    if ninja -C "$MOK_BUILD" -t query "${target_of[$k]}" >/dev/null 2>&1; then
      targets+=(--target "${target_of[$k]}")
    else
      mok_log "target ${target_of[$k]} is not defined: its runs will fail as 'binary not found'"
    fi
  done
  # A failed build stops here (common.sh's set -e): never sanitize stale binaries.
  [ ${#targets[@]} -eq 0 ] || mok_build "${targets[@]}"
fi
if [ "$dry_run" != 1 ]; then
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  [ -x "$cs" ] || { mok_log "compute-sanitizer not found"; exit 2; }
fi

# --- Runs ---------------------------------------------------------------------------------------
set +e  # from here every run is judged from its log, and all of them run
results="$(mktemp -d)"
# Each run's timeout(1) is in its own process group (so a terminal's Ctrl-C does not reach it):
# on an interrupt, stop the ones still running by their recorded pid.
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
  local f
  for f in "$results"/*.pid; do [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null; done
  wait  # for the runs' shells to record their end, before their directory goes
  rm -rf "$results"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export MOK_TEST_WAIT_TIMEOUT_S=120
# racecheck runs get the forward's comm CTAs in rounds with a CTA barrier between them
# (MOK_MK_MOVER_ROUNDS=1, forward_comm.cuh): racecheck does not see how one thread's consecutive bulk
# copies through its own row buffer are ordered (the mbarrier, the bulk store's read wait) and
# reports each refill as a race unless a barrier it models separates them. The barrier adds no
# ordering the code relies on (every buffer has one owner) and costs up to 6% of the forward at
# small H, so the layer runs without it, and so do the other tools' runs: they check that path.
# Two repetitions per layer case (still a run-to-run bit comparison): every launch is slow under
# the tools, and the layer cases repeat three to twenty times otherwise.
export MOK_TEST_REPS="${MOK_TEST_REPS:-2}"

run_one() {  # index: writes $results/<index>.tsv
  local i="$1" tool="${run_tool[$1]}" test="${run_test[$1]}" filter="${run_filter[$1]}"
  local bin="${path_of[${run_key[$1]}]}" log="$OUT/${run_tool[$1]}-${run_test[$1]}.log"
  local id rc t0 t1 seconds errors passed failed clean
  id="$(printf '%03d' "$i")"
  local rounds=0
  [ "$tool" = racecheck ] && rounds=1
  local cmd=(env MOK_MK_MOVER_ROUNDS="$rounds" timeout -k 30 "$timeout_s" "$cs" --tool "$tool" --report-api-errors no
             --print-limit 100 "$bin" --gtest_filter="$filter")
  if [ "$dry_run" = 1 ]; then
    printf 'MOK_TEST_WAIT_TIMEOUT_S=120'; printf ' %q' "${cmd[@]}"; printf ' >%q 2>&1\n' "$log"
    printf '%s\t%s\t%s\t%s\tnull\t0.0\tnull\tnull\tnull\tfalse\n' \
      "$tool" "$test" "$bin" "$filter" >"$results/$id.tsv"
    return
  fi
  t0="$(date +%s.%N)"
  if [ -x "$bin" ]; then
    "${cmd[@]}" >"$log" 2>&1 </dev/null &
    echo $! >"$results/$id.pid"
    wait $!
    rc=$?
    rm -f "$results/$id.pid"
  else
    echo "binary not found: $bin (target ${target_of[${run_key[$1]}]})" >"$log"
    rc=127
  fi
  t1="$(date +%s.%N)"
  seconds="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  IFS=$'\t' read -r errors passed failed clean <<<"$(mok_sanitize_judge "$tool" "$log" "$rc")"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$tool" "$test" "$bin" "$filter" \
    "$errors" "$seconds" "$passed" "$failed" "$rc" "$clean" >"$results/$id.tsv"
  mok_log "$tool $test: rc $rc, $seconds s, $passed passed, $failed failed, errors $errors," \
          "clean $clean ($log)"
}

# Runs that need the machine's host memory to themselves: racecheck keeps a shadow of every
# access, and over these layer cases it grew to ~78 GB (bwd_saved_forwards) and past 90 GB
# (bwd_windows_uniform) on the 128 GB H200 machine (free sampled every 10 s): two of them at once,
# or one beside other runs, got the process killed (rc 9, no verdict). Each runs alone.
solo=" racecheck:bwd_windows_uniform racecheck:bwd_saved_forwards "
mok_log "${#run_tool[@]} runs, $max_jobs at a time, ${timeout_s} s each at most; logs in $OUT"
for i in "${!run_tool[@]}"; do
  if [ "$dry_run" != 1 ] && [[ "$solo" == *" ${run_tool[$i]}:${run_test[$i]} "* ]]; then
    wait  # every other run ends first, and none starts until this one has ended
    run_one "$i"
    continue
  fi
  # A counting semaphore over the background jobs: wait for one to end before starting another.
  while [ "$(jobs -rp | wc -l)" -ge "$max_jobs" ]; do wait -n; done
  if [ "$dry_run" = 1 ]; then run_one "$i"; else run_one "$i" & fi
done
wait

# --- sanitize.json and the table ----------------------------------------------------------------
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
commit="${MOK_COMMIT:-$(git -C "$MOK_ROOT" rev-parse HEAD 2>/dev/null)}"
python3 - "$results" "$OUT/sanitize.json" "${device:-unknown}" "${commit:-unknown}" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${#run_tool[@]}" "$dry_run" <<'EOF'
import json, os, sys

results, out, device, commit, date, expected, dry_run = sys.argv[1:]
keys = ["tool", "test", "binary", "filter", "errors", "seconds", "passed_tests", "failed_tests",
        "rc", "clean"]
runs = []
for i in range(int(expected)):
    path = os.path.join(results, "%03d.tsv" % i)
    if not os.path.exists(path):  # a run whose shell died before writing: a failure, not a gap
        runs.append(None)
        continue
    with open(path) as f:
        fields = f.read().rstrip("\n").split("\t")
    run = dict(zip(keys, fields))
    for k in ("errors", "passed_tests", "failed_tests", "rc"):
        run[k] = None if run[k] == "null" else int(run[k])
    run["seconds"] = float(run["seconds"])
    run["clean"] = run["clean"] == "true"
    runs.append(run)
missing = [i for i, r in enumerate(runs) if r is None]
runs = [r for r in runs if r is not None]
doc = {"device": device, "date": date, "commit": commit, "runs": runs}
if dry_run == "1":
    doc["dry_run"] = True
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(tmp, out)

def cell(v):
    return "-" if v is None else str(v)

print("%-10s %-32s %7s %8s %4s %4s %4s  %s" % ("tool", "test", "errors", "seconds", "pass",
                                               "fail", "rc", "verdict"))
for r in runs:
    verdict = "dry run" if dry_run == "1" else ("clean" if r["clean"] else "NOT CLEAN")
    print("%-10s %-32s %7s %8.1f %4s %4s %4s  %s" % (
        r["tool"], r["test"], cell(r["errors"]), r["seconds"], cell(r["passed_tests"]),
        cell(r["failed_tests"]), cell(r["rc"]), verdict))
for i in missing:
    print("run %d wrote no result (its shell died): counted as not clean" % i)
print("%d runs, %d clean -> %s" % (len(runs) + len(missing), sum(r["clean"] for r in runs), out))
sys.exit(0 if not missing and all(r["clean"] for r in runs) else 1)
EOF
status=$?
if [ "$dry_run" = 1 ]; then exit 0; fi
exit "$status"
