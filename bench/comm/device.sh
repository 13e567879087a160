#!/usr/bin/env bash
# One call on the 2-GPU machine: build the communication layer against the NCCL that PyTorch
# ships (the one processes load), check ptxas, run the comm tests (CPU + GPU), run the bench.
#   device tool: run(command="bash bench/comm/device.sh <commit>", carry=[".deps"], kind nvidia-h200-x2)
# Writes under $OUT: comm-h200x2.json, bench.log, tests.log, build.log, env.txt (at most 8 files).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/mok-comm-out}"
mkdir -p "$OUT"
COMMIT="${1:-unknown}"
MODE="${2:-all}"   # all: tests + bench; probe: per-SM and NVLink-counter probes only
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
B=build/comm-device
T0=$(date +%s)
stamp() { echo "[device.sh +$(( $(date +%s) - T0 ))s] $*"; }

NCCL_ROOT="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
NCCL_ARG=()
[ -n "$NCCL_ROOT" ] && NCCL_ARG=(-DMOK_NCCL_ROOT="$NCCL_ROOT")
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  nvidia-smi topo -m
  echo "NCCL root: $NCCL_ROOT"; ls -l "$NCCL_ROOT/lib"
  env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM|CUDA)' | sort
} > "$OUT/env.txt" 2>&1

stamp "configure (MOK_NCCL_ROOT=$NCCL_ROOT)"
GT=()
[ -f .deps/googletest/CMakeLists.txt ] && GT=(-DMOK_GTEST_SOURCE="$PWD/.deps/googletest")
if ! cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release ${NCCL_ARG[@]+"${NCCL_ARG[@]}"} ${GT[@]+"${GT[@]}"} \
     > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
stamp "build"
TARGETS=(mok_cpu_comm_tests mok_gpu_comm_tests mok_gpu_comm_env_tests mok_comm_env_worker mok_comm_bench)
[ "$MODE" = probe ] && TARGETS=(mok_comm_bench)
if ! cmake --build "$B" -j "$(nproc)" --target "${TARGETS[@]}" >> "$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1
fi
ldd "$B/bench/comm/mok_comm_bench" | grep -i nccl | tee -a "$OUT/env.txt"
python3 tools/ptxas_check.py --build-dir "$B" --allow tools/ptxas_allow.txt > "$OUT/ptxas.txt" 2>&1
echo "ptxas check rc=$? ($(tail -1 "$OUT/ptxas.txt"))"

if [ "$MODE" = probe ]; then
  stamp "probe"
  timeout 150 "$B/bench/comm/mok_comm_bench" --probe > "$OUT/probe.log" 2>&1
  PRC=$?
  stamp "probe rc=$PRC"
  grep -E "^\[probe" "$OUT/probe.log"
  [ $PRC -ne 0 ] && tail -20 "$OUT/probe.log"
  exit $PRC
fi
stamp "bench"
timeout 200 "$B/bench/comm/mok_comm_bench" --out "$OUT/comm-h200x2.json" --commit "$COMMIT" > "$OUT/bench.log" 2>&1
BRC=$?
stamp "bench rc=$BRC"
stamp "tests"
( cd "$B" && timeout 280 ctest -V -R '^Comm' --timeout 120 ) > "$OUT/tests.log" 2>&1
TRC=$?
grep -E "tests passed|tests failed|Failed|\*\*\*|SKIPPED|hand-offs|timeout error|teardown" "$OUT/tests.log" | head -40
stamp "tests rc=$TRC"

sed -n '/=== comm bench/,$p' "$OUT/bench.log"
[ $BRC -ne 0 ] && tail -30 "$OUT/bench.log"
echo "tests rc=$TRC bench rc=$BRC"
exit $(( TRC != 0 || BRC != 0 ))
