#!/usr/bin/env bash
# Binaries built on this (GPU-less) machine and carried to a device call, so that the call spends
# its minutes on tests and timings instead of a build (the full tree takes ~4 min there).
#
#   scripts/prebuilt.sh pack [binary ...]   here: build the GPU test binaries and mok_bench (or the
#                                           named ones) in build/release, strip copies into devrun/
#                                           (git-ignored) with devrun/commit; and, where a build
#                                           dir for the device's Python (3.12) exists
#                                           (MOK_PREBUILT_PY_BUILD, default build/py312: configured
#                                           with -DMOK_BUILD_PYTHON=ON by a 3.12 interpreter), the
#                                           extension modules into devrun/pk/.
#   scripts/prebuilt.sh pack-base <commit>  here: mok_bench of another commit (a worktree built in
#                                           /tmp) into devrun/base/, for an A/B of two builds in one
#                                           call (bench/knobs_ab.sh, a variant's BENCH= item).
#   scripts/prebuilt.sh squeeze [dir ...]   here: devrun/<dir> (default: every folder in devrun/)
#                                           into devrun/<dir>.txz (xz) and the folder removed: the
#                                           stripped binaries shrink ~7x (31 MiB -> 4.4), so one
#                                           call can carry several builds; `env` unpacks them.
#   source scripts/prebuilt.sh env          there, in the call (carry ["devrun"]): devrun/*.txz
#                                           unpacked (where its folder is absent), NCCL's wheel
#                                           library (torch's, which the binaries must load, not the
#                                           system's older one) on LD_LIBRARY_PATH, the package
#                                           (python/mok + devrun/pk) on PYTHONPATH, MOK_COMMIT.
#
# A call's carry is at most 64 MiB: the default set is ~47 MiB stripped (a04cb88), ~58 with the Python
# extension (c31bf43); a base mok_bench adds 2 (c5c4276's) to 11 (name fewer binaries then). Build and device share
# nvcc 13.0 and NCCL 2.28.9 (notes/device-env.md); a binary built against other NCCL headers than
# the device's would fail its version check at start.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || set -uo pipefail  # (sourced: the caller's shell options stay)
MOK_PREBUILT_DEFAULT=(mok_bench mok_gpu_gemm_primitive_tests mok_gpu_gemm_tests mok_gpu_layer_tests
                      mok_gpu_reliability_tests mok_gpu_movement_tests mok_gpu_merge_tests mok_gpu_schedule_tests
                      mok_wgmma_rate)

# Builds targets in a build dir of the tree at $1 (scripts/common.sh's configure and build).
mok_prebuilt_build() {
  local tree="$1" build="$2"
  shift 2
  (
    export MOK_BUILD="$build"
    source "$tree/scripts/common.sh"
    mok_ensure_deps
    mok_build --target "$@"
  )
}

mok_prebuilt_pack() {
  local root build py_build bins=("$@") out
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  build="${MOK_BUILD:-$root/build/release}"
  py_build="${MOK_PREBUILT_PY_BUILD:-$root/build/py312}"
  [ ${#bins[@]} -gt 0 ] || bins=("${MOK_PREBUILT_DEFAULT[@]}")
  mok_prebuilt_build "$root" "$build" "${bins[@]}" || { echo "prebuilt: the build failed" >&2; return 1; }
  out="$root/devrun"
  rm -rf "$out/bin" "$out/pk"  # (a pack-base binary in devrun/base stays)
  mkdir -p "$out/bin"
  local b f
  for b in "${bins[@]}"; do
    f="$(find "$build" -type f -name "$b" -perm -u+x | head -1)"
    [ -n "$f" ] || { echo "prebuilt: no built binary named $b under $build" >&2; return 1; }
    cp "$f" "$out/bin/" && strip "$out/bin/$b"
  done
  if [ -f "$py_build/build.ninja" ]; then
    local mods
    mods="$(cd "$py_build" && ninja -t targets all | sed -n 's|^\(python/_[a-z]*\.cpython-[^:]*\.so\):.*|\1|p')"
    if [ -n "$mods" ]; then
      # shellcheck disable=SC2086
      ninja -C "$py_build" $mods >/dev/null || { echo "prebuilt: the Python extension build failed" >&2; return 1; }
      mkdir -p "$out/pk"
      for f in $mods; do cp "$py_build/$f" "$out/pk/" && strip "$out/pk/$(basename "$f")"; done
    fi
  fi
  git -C "$root" rev-parse --short HEAD >"$out/commit"
  git -C "$root" diff --quiet HEAD -- src include bench tests python || echo "+local changes" >>"$out/commit"
  du -sh "$out" | sed 's/^/prebuilt: /'
  local kib
  kib="$(du -sk "$out" | cut -f1)"
  [ "$kib" -le $((64 * 1024)) ] || echo "prebuilt: devrun/ is over a call's 64 MiB carry: name fewer binaries" >&2
}

mok_prebuilt_pack_base() {
  local root commit wt
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  commit="$(git -C "$root" rev-parse --short "${1:?pack-base: name the base commit}")" || return 2
  wt="${MOK_PREBUILT_BASE_TREE:-/tmp/mok-base-$commit}"
  [ -d "$wt" ] || git -C "$root" worktree add --detach "$wt" "$commit" >/dev/null || return 1
  mok_prebuilt_build "$wt" "$wt/build/release" mok_bench || { echo "prebuilt: the base build failed" >&2; return 1; }
  mkdir -p "$root/devrun/base"
  cp "$wt/build/release/bench/mok_bench" "$root/devrun/base/" && strip "$root/devrun/base/mok_bench"
  echo "$commit" >"$root/devrun/base/commit"
  du -sh "$root/devrun" | sed 's/^/prebuilt: /'
}

mok_prebuilt_squeeze() {
  local root dirs=("$@") d
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [ ${#dirs[@]} -eq 0 ]; then
    for d in "$root"/devrun/*/; do [ -d "$d" ] && dirs+=("$(basename "$d")"); done
  fi
  for d in "${dirs[@]}"; do
    [ -d "$root/devrun/$d" ] || { echo "prebuilt: no folder devrun/$d" >&2; return 1; }
    tar cJf "$root/devrun/$d.txz" -C "$root/devrun" "$d" && rm -rf "${root:?}/devrun/$d" || return 1
  done
  du -sh "$root/devrun" | sed 's/^/prebuilt: /'
}

mok_prebuilt_env() {
  local root nccl t
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  for t in "$root"/devrun/*.txz; do  # (squeeze's archives)
    [ -f "$t" ] && [ ! -d "${t%.txz}" ] || continue
    tar xJf "$t" -C "$root/devrun" 2>/dev/null ||  # (no xz there: Python's lzma)
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$t" "$root/devrun"
  done
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64${nccl:+:$nccl}"
  export MOK_COMMIT="$(head -1 "$root/devrun/commit" 2>/dev/null || echo unknown)"
  chmod +x "$root"/devrun/bin/* "$root"/devrun/base/* 2>/dev/null
  if [ -d "$root/devrun/pk" ]; then
    local pk=/tmp/mok-prebuilt-pk
    rm -rf "$pk" && mkdir -p "$pk/mok" && cp "$root"/python/mok/*.py "$pk/mok/" && cp "$root"/devrun/pk/*.so "$pk/mok/"
    export PYTHONPATH="$pk${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

case "${1:-}" in
  pack) shift; mok_prebuilt_pack "$@" ;;
  pack-base) shift; mok_prebuilt_pack_base "$@" ;;
  squeeze) shift; mok_prebuilt_squeeze "$@" ;;
  env) mok_prebuilt_env ;;
  *) sed -n '2,/^[^#]/p' "${BASH_SOURCE[0]}" | grep '^#'; [ "${1:-}" = --help ] || [ "${1:-}" = -h ] ;;
esac
