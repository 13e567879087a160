#!/usr/bin/env bash
# One call on a GPU machine: print the environment, build, run the CPU and GPU tests, run the
# main job. Logs go to $OUT (when set). Usage (from the repo root):
#   [MOK_TARGETS="t1 t2 ..."] [MOK_COMMIT=<hash>] [MOK_SKIP_MAIN=1] [MOK_SCHEDULE_BENCH=1]
#   scripts/device.sh [ctest -R regex]
# MOK_TARGETS limits the build to those targets (others' unfinished areas cannot break the run);
# the build keeps going past failures (-k 0) either way.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/mok-out}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
{
  echo "== environment"
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  nvcc --version | tail -2
  cmake --version | head -1
  ninja --version
  python3 -c "import torch, os, nvidia.nccl as n; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'nccl dir', os.path.dirname(n.__path__[0] if hasattr(n,'__path__') else n.__file__))" 2>&1
  python3 -c "import nvidia.nccl, os; p=list(nvidia.nccl.__path__)[0]; print('nccl pkg', p, os.listdir(p), os.listdir(os.path.join(p,'lib')))" 2>&1
  ls /usr/include/nccl*.h /usr/lib/x86_64-linux-gnu/libnccl* 2>&1 | head
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/env.txt"
export MOK_GTEST_SOURCE="$ROOT/.deps/googletest"
export MOK_BUILD="$ROOT/build/device"
cd "$ROOT"
set -o pipefail
targets=()
for t in ${MOK_TARGETS:-}; do targets+=(--target "$t"); done
( source scripts/common.sh && mok_ensure_deps && mok_build "${targets[@]}" -- -k 0 ) 2>&1 | tee "$OUT/build.log" | grep -E "FAILED|error" | head -20
cd build/device
ctest -L cpu -j 8 --output-on-failure ${1:+-R "$1"} 2>&1 | tee "$OUT/ctest-cpu.log" | tail -4
if [ $# -gt 0 ]; then
  ctest -L gpu --output-on-failure -R "$1" 2>&1 | tee "$OUT/ctest-gpu.log" | tail -15
else
  ctest -L gpu --output-on-failure 2>&1 | tee "$OUT/ctest-gpu.log" | tail -15
fi
cd "$ROOT"
gpus="$(nvidia-smi -L | grep -c '^GPU ')"
gpu_tag="$(source scripts/common.sh && mok_gpu_tag)"
if [ -x build/device/bench/schedule/schedule_bench ] && [ "${MOK_SCHEDULE_BENCH:-0}" = 1 ]; then
  build/device/bench/schedule/schedule_bench "$OUT/schedule-$gpu_tag.json" 2>&1 | tee "$OUT/schedule_bench.log" | tail -14
fi
# The main job (README's run command): mok vs the PyTorch+NCCL baseline in one run.
[ "${MOK_SKIP_MAIN:-0}" = 1 ] || MOK_OUT="$OUT" timeout 900 scripts/run.sh ${MOK_BENCH_ARGS:-} 2>&1 | tee "$OUT/run.log" | grep -vE "^\[mok\] (building|configuring)" | tail -30
