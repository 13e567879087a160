#!/usr/bin/env bash
# Builds mok and runs its tests: CPU tests always, GPU tests where GPUs are visible.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mok_ensure_deps
mok_build
cd "$MOK_BUILD"
mok_log "running CPU tests (label cpu)"
ctest -L cpu --output-on-failure -j "$(nproc)" --timeout 1200
"$MOK_ROOT/scripts/python_tests.sh"
gpus="$(mok_gpu_count)"
if [ "$gpus" -gt 0 ]; then
  mok_log "running GPU tests (label gpu) on $gpus GPU(s)"
  ctest -L gpu --output-on-failure --timeout 1200
else
  mok_log "no GPU visible: GPU tests (label gpu) were built but not run"
fi
