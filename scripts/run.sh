#!/usr/bin/env bash
# Builds mok and runs the main job: the MoE layer benchmark on all visible GPUs, compared in the
# same run with the PyTorch+NCCL baseline (when python3 has torch); on a machine without a GPU
# (or with --cpu), the CPU reference engine on simulated ranks. Arguments go to mok_bench
# (scripts/run.sh --help). Results: $MOK_OUT (default build/results) as JSON: on GPUs
# forward-<gpu>x<n>.json (with the baseline), on the CPU mok-cpu.json.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# --help: the usage text mok_bench itself prints (one file), before anything is installed or built.
# Every other argument is checked by mok_bench alone, so the messages are the same either way.
for a in "$@"; do
  case "$a" in --help|-h)
    echo "usage: scripts/run.sh [mok_bench options]"
    echo "Builds mok_bench in \$MOK_BUILD (default build/release; MOK_BENCH=<path>: that binary, no build) and"
    echo "runs it with these options; on GPUs it also runs the PyTorch+NCCL baseline. Results as JSON under"
    echo "\$MOK_OUT (default build/results): forward-<gpu>x<n>.json on GPUs, mok-cpu.json (with the verdict)"
    echo "on the CPU. On GPUs the same cases run again in FP8 and MXFP8 (--precision fp8 / mxfp8: the FP8"
    echo "megakernels, forward only; MOK_FP8=0 skips both, MOK_MXFP8=0 the MXFP8 one, and so does giving"
    echo "--precision or --path). MOK_MAIN_STEP=bench runs mok_bench's passes only and keeps their JSON"
    echo "in \$MOK_OUT; MOK_MAIN_STEP=baseline then runs only the baseline and the report on those JSON files"
    echo "(two device calls of under 10 minutes each; default: all)."
    echo
    cat "$MOK_ROOT/bench/mok_bench_usage.txt"
    exit 0 ;;
  esac
done
# MOK_BENCH=<a built mok_bench>: run that one, build nothing (a GPU machine's call with prebuilt
# binaries: scripts/prebuilt.sh, scripts/ep_device.sh).
if [ -n "${MOK_BENCH:-}" ]; then
  [ -f "$MOK_BENCH" ] && [ -x "$MOK_BENCH" ] || { mok_log "MOK_BENCH=$MOK_BENCH is not an executable file"; exit 2; }
  bench="$MOK_BENCH"
else
  mok_ensure_deps
  mok_build --target mok_bench
  bench="$MOK_BUILD/bench/mok_bench"
fi
out="${MOK_OUT:-$MOK_ROOT/build/results}"
mkdir -p "$out"
# The commit the results files record (the GPU machines get a tree without .git and pass it in).
if [ -z "${MOK_COMMIT:-}" ] && git -C "$MOK_ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
  MOK_COMMIT="$(git -C "$MOK_ROOT" rev-parse --short HEAD)"
  git -C "$MOK_ROOT" diff --quiet HEAD -- 2>/dev/null || MOK_COMMIT="$MOK_COMMIT+uncommitted"
  export MOK_COMMIT
fi
gpus="$(mok_gpu_count)"
case " $* " in *" --cpu "*) gpus=0 ;; esac
# The CPU reference engine on simulated ranks, ending with its verdict against the fp64 model
# (exit status 1 on FAIL). --json goes first so that one among the user's options names the file.
if [ "$gpus" -eq 0 ]; then
  exec "$bench" --json "$out/mok-cpu.json" "$@"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
tag="$(mok_gpu_tag)"
# MOK_MAIN_STEP: all (default); bench = mok_bench's passes only; baseline = the baseline and the
# report on the JSON a bench step left in $out (one device call each: a call lasts at most 10 min).
step="${MOK_MAIN_STEP:-all}"
case "$step" in all|bench|baseline) ;; *) mok_log "MOK_MAIN_STEP must be all, bench or baseline, got '$step'"; exit 2 ;; esac
# run.sh's --json goes before the user's options, so that a value missing at their end is reported
# for the user's option; a --json among them names the results file instead.
mok_json="$out/mok-forward-$tag.json"
prev=""
for a in "$@"; do
  [ "$prev" = --json ] && mok_json="$a"
  prev="$a"
done
status=0
fp8_reports=()
sampler=""
samples="$out/gpu-samples-$tag.csv"
if [ "$step" = baseline ]; then
  [ -f "$mok_json" ] || { mok_log "MOK_MAIN_STEP=baseline: no $mok_json (run MOK_MAIN_STEP=bench first)"; exit 2; }
  for p in fp8 mxfp8; do
    [ -f "$out/mok-forward-$p-$tag.json" ] && fp8_reports+=(--fp8 "$out/mok-forward-$p-$tag.json")
  done
else
  # nvidia-smi samples (clock, power, clock event reasons) while mok_bench runs: the report states
  # the sustained SM clock and whether the power cap held it down.
  rm -f "$samples"
  if command -v nvidia-smi >/dev/null; then
    reasons=clocks_event_reasons.active
    nvidia-smi --query-gpu=$reasons --format=csv,noheader >/dev/null 2>&1 || reasons=clocks_throttle_reasons.active
    nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw,power.limit,$reasons \
      --format=csv,noheader,nounits -lms 50 >"$samples" 2>/dev/null &
    sampler=$!
  fi
  "$bench" --json "$mok_json" "$@" || status=$?
  # The same cases in FP8 (block-scaled recipe 1, the FP8 megakernel) and MXFP8 (recipe 2, re-blocked
  # onto the same kernels), unless the options already chose a precision or MOK_FP8=0 (MOK_MXFP8=0:
  # no MXFP8 pass): forward only, no ablation; joined below as cases with precision "fp8" / "mxfp8"
  # beside the bf16 ones.
  case " $* " in *" --precision "*|*" --path "*) MOK_FP8="${MOK_FP8:-0}" ;; esac
  if [ "$status" -eq 0 ] && [ "${MOK_FP8:-1}" = 1 ]; then
    fp8_args=()
    prev=""
    for a in "$@"; do
      case "$prev" in --models|--tokens|--routings|--iters|--warmup|--sustain|--comm-sms) fp8_args+=("$prev" "$a") ;; esac
      prev="$a"
    done
    precisions=(fp8)
    [ "${MOK_MXFP8:-1}" = 1 ] && precisions+=(mxfp8)
    for p in "${precisions[@]}"; do
      p_json="$out/mok-forward-$p-$tag.json"
      mok_log "the same cases in ${p^^} (mok_bench --precision $p)"
      if "$bench" --json "$p_json" --precision "$p" --no-ablation --no-backward "${fp8_args[@]}"; then
        fp8_reports+=(--fp8 "$p_json")
      else
        mok_log "the ${p^^} pass failed: the report has no $p cases"
      fi
    done
  fi
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
fi
[ "$status" -eq 0 ] || exit "$status"
if [ "$step" = bench ]; then
  mok_log "MOK_MAIN_STEP=bench: mok_bench's JSON are in $out; MOK_MAIN_STEP=baseline runs the baseline and the report"
  exit 0
fi
# The baseline runs the shapes mok_bench ran and follows its --sustain (default 4 s), so both
# report the rate under the same sustained load.
base_args=(--sustain 4)
prev=""
for a in "$@"; do
  case "$prev" in --sustain|--models|--tokens|--routings|--iters|--warmup) base_args+=("$prev" "$a") ;; esac
  prev="$a"
done
if python3 -c "import torch" 2>/dev/null; then
  mok_log "running the PyTorch+NCCL baseline on $gpus GPU(s)"
  PYTHONUNBUFFERED=1 python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
    "$MOK_ROOT/bench/baseline/torch_moe_baseline.py" "${base_args[@]}" --out "$out/baseline-$tag.json" 2>&1 |
    grep -E "^\[baseline\]|Error" || true
  if [ -f "$out/baseline-$tag.json" ]; then
    python3 "$MOK_ROOT/bench/forward_report.py" ${fp8_reports[@]+"${fp8_reports[@]}"} "$mok_json" "$out/baseline-$tag.json" \
      "$out/forward-$tag.json" "$samples"
  fi
else
  mok_log "python3 has no torch: the PyTorch+NCCL baseline was not run"
fi
