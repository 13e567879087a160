# Shared by scripts/run.sh and scripts/test.sh: install what the build needs, then configure and
# build. Sourced, not executed.
set -euo pipefail
MOK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOK_BUILD="${MOK_BUILD:-$MOK_ROOT/build/release}"

mok_log() { echo "[mok] $*" >&2; }

# Debian packages the build needs; installed with apt-get when missing (CI and fresh machines).
mok_ensure_deps() {
  local need=()
  # CMake >= 3.25 (from `cmake --version`: `cmake -P /dev/stdin` cannot read a here-string,
  # which bash >= 5.1 passes through a pipe).
  local cmake_version
  cmake_version="$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9]*\.[0-9]*\).*/\1/p' || true)"
  if [ -z "$cmake_version" ] || ! printf '3.25\n%s\n' "$cmake_version" | sort -V -C; then need+=(cmake); fi
  command -v ninja >/dev/null || need+=(ninja-build)
  command -v g++ >/dev/null || need+=(g++)
  command -v python3 >/dev/null || need+=(python3)
  if [ ! -f /usr/include/gtest/gtest.h ] && [ -z "${MOK_GTEST_SOURCE:-}" ]; then
    if [ -f "$MOK_ROOT/.deps/googletest/CMakeLists.txt" ]; then
      export MOK_GTEST_SOURCE="$MOK_ROOT/.deps/googletest"
    else
      need+=(libgtest-dev)
    fi
  fi
  if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      mok_log "installing Debian packages: ${need[*]}"
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
      mok_log "installing Debian packages with sudo: ${need[*]}"
      sudo apt-get update -qq >/dev/null
      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      mok_log "missing: ${need[*]} (install them, e.g. apt-get install ${need[*]})"
      exit 1
    fi
  fi
  # The CUDA 13 toolkit (nvcc, CCCL, NCCL headers) is required to build: mok's kernels are
  # compiled and their ptxas reports checked even where no GPU exists.
  if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
      [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
    done
  fi
  if ! command -v nvcc >/dev/null; then
    mok_log "nvcc not found: mok needs the CUDA 13 toolkit (https://developer.nvidia.com/cuda-downloads)"
    exit 1
  fi
}

mok_build() {
  local extra=()
  [ -n "${MOK_GTEST_SOURCE:-}" ] && extra+=("-DMOK_GTEST_SOURCE=$MOK_GTEST_SOURCE")
  if [ ! -f "$MOK_BUILD/build.ninja" ]; then
    mok_log "configuring in $MOK_BUILD"
    cmake -S "$MOK_ROOT" -B "$MOK_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null
  fi
  mok_log "building ($(nproc) jobs)"
  cmake --build "$MOK_BUILD" -j "$(nproc)" "$@"
}

mok_gpu_count() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

# The GPU's model as results files name it, from nvidia-smi's name: the first word that is letters
# then digits ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200, "NVIDIA GH200 480GB" -> gh200,
# "NVIDIA A100-SXM4-80GB" -> a100), else the first word with a digit, else "gpu". (The name's last
# word, used before, gave "hbm3" on an H100.)
mok_gpu_model() {
  local w first_digit=""
  for w in $(echo "$1" | tr '[:upper:]-' '[:lower:] '); do
    [ "$w" = nvidia ] && continue
    if [[ "$w" =~ ^[a-z]+[0-9]+[a-z]*$ ]]; then echo "$w"; return; fi
    [[ -z "$first_digit" && "$w" =~ [0-9] ]] && first_digit="$w"
  done
  echo "${first_digit:-gpu}"
}

# e.g. "h200x2": the GPU's model word and the count, for results file names.
mok_gpu_tag() {
  local n name
  n="$(mok_gpu_count)"
  name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo "$(mok_gpu_model "$name")x$n"
}
