#!/usr/bin/env bash
# Builds mok and runs the main job: the MoE layer benchmark on all visible GPUs, compared in the
# same run with the PyTorch+NCCL baseline (when python3 has torch); on a machine without a GPU
# (or with --cpu), the CPU reference engine on simulated ranks. Arguments go to mok_bench
# (scripts/run.sh --help). Results: $MOK_OUT (default build/results) as JSON.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mok_ensure_deps
mok_build --target mok_bench
bench="$MOK_BUILD/bench/mok_bench"
gpus="$(mok_gpu_count)"
case " $* " in *" --cpu "*|*" --help "*|*" -h "*) gpus=0 ;; esac
if [ "$gpus" -eq 0 ]; then
  exec "$bench" "$@"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
out="${MOK_OUT:-$MOK_ROOT/build/results}"
mkdir -p "$out"
tag="$(mok_gpu_tag)"
"$bench" "$@" --json "$out/mok-forward-$tag.json"
if python3 -c "import torch" 2>/dev/null; then
  mok_log "running the PyTorch+NCCL baseline on $gpus GPU(s)"
  PYTHONUNBUFFERED=1 python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
    "$MOK_ROOT/bench/baseline/torch_moe_baseline.py" --out "$out/baseline-$tag.json" 2>&1 |
    grep -E "^\[baseline\]|Error" || true
  if [ -f "$out/baseline-$tag.json" ]; then
    python3 "$MOK_ROOT/bench/forward_report.py" "$out/mok-forward-$tag.json" "$out/baseline-$tag.json" \
      "$out/forward-$tag.json"
  fi
else
  mok_log "python3 has no torch: the PyTorch+NCCL baseline was not run"
fi
