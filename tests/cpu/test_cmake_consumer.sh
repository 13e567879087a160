#!/usr/bin/env bash
# mok as a CMake package (ctest mok_cmake_consumer, label cpu): installs the built tree into a
# temporary prefix with `cmake --install`, checks what was installed (public headers, the static
# libraries, the package files; no tests, benchmarks or src/ headers, and no path into the source
# or build tree in the exported targets), then configures, builds and runs tests/consumer against
# it (find_package(mok CONFIG), mok::mok, no C++ standard set by the consumer). Last, configures
# tests/consumer with add_subdirectory(<source tree>) and compiles its main.cpp (the object only:
# mok's kernels are not rebuilt), which needs C++20 and the include path to propagate too.
# Usage: test_cmake_consumer.sh <build dir> <source dir> <C++ compiler> <CUDA compiler> <ninja>
set -uo pipefail
build="$1" root="$2" cxx="$3" nvcc="$4" ninja="$5"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
# run LOG CMD...: runs CMD with its output in LOG; on failure prints the log's tail and returns 1.
run() {
  local log="$1"
  shift
  if ! "$@" >"$log" 2>&1; then
    echo "command failed: $*" >&2
    tail -40 "$log" >&2
    return 1
  fi
}
# Same compilers and build program as the build under test; Release like scripts/test.sh.
consumer_args=(-G Ninja -DCMAKE_MAKE_PROGRAM="$ninja" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release)

# 1. Install.
run "$tmp/install.log" cmake --install "$build" --prefix "$prefix" || exit 1
(cd "$prefix" && find . -type f | sed 's|^\./||' | sort) >"$tmp/files"
echo "installed $(wc -l <"$tmp/files") files into the prefix"
unexpected="$(grep -vE '^include/mok/[a-z0-9_]+\.hpp$|^lib(64)?/libmok_[a-z]+\.a$|^lib(64)?/cmake/mok/mok(Config|ConfigVersion|Targets|Targets-release)\.cmake$' "$tmp/files")"
[ -z "$unexpected" ] || fail "unexpected installed files (tests, benchmarks, internal headers?): $unexpected"
for header in "$root"/include/mok/*.hpp; do
  grep -qx "include/mok/$(basename "$header")" "$tmp/files" || fail "public header not installed: $(basename "$header")"
done
for lib in core cuda comm schedule movement gemm layer; do
  grep -qE "^lib(64)?/libmok_$lib\.a$" "$tmp/files" || fail "library not installed: libmok_$lib.a"
done
# Public headers include only each other, the standard library, CUDA and NCCL (nothing of src/).
bad_includes="$(grep -hE '^#include "' "$prefix"/include/mok/*.hpp | grep -vE '^#include "mok/[a-z0-9_]+\.hpp"' || true)"
[ -z "$bad_includes" ] || fail "public headers include non-public headers: $bad_includes"
targets_dir="$(dirname "$(find "$prefix" -name mokTargets.cmake | head -1)")"
if grep -qF -e "$root" -e "$build" "$targets_dir"/mokTargets*.cmake; then
  fail "exported targets name the source or build tree: $(grep -hF -e "$root" -e "$build" "$targets_dir"/mokTargets*.cmake | head -3)"
fi

# 2. A consumer of the installed package: configure, build, run.
if run "$tmp/configure.log" cmake -S "$root/tests/consumer" -B "$tmp/consumer" "${consumer_args[@]}" \
       -DCMAKE_PREFIX_PATH="$prefix"; then
  if run "$tmp/build.log" cmake --build "$tmp/consumer" -j 2 -v; then
    # C++20 came from mok::mok (the consumer sets no standard), the include path from the prefix.
    grep -q -- '-std=c++20\|-std=gnu++20' "$tmp/build.log" || fail "consumer compiled without C++20: $(grep main.cpp "$tmp/build.log" | head -1)"
    grep -qF -- "-I$prefix/include" "$tmp/build.log" || grep -qF -- "-isystem $prefix/include" "$tmp/build.log" ||
      fail "consumer compiled without the installed include dir"
    if grep -qF -- "$root/src" "$tmp/build.log"; then fail "consumer's build names the source tree's src/"; fi
    rc=0
    "$tmp/consumer/mok_consumer" >"$tmp/out" 2>&1 || rc=$?
    cat "$tmp/out"
    [ "$rc" -eq 0 ] || fail "mok_consumer: exit code $rc"
    grep -qx "mok consumer: ok" "$tmp/out" || fail "mok_consumer did not finish its checks"
    # The CPU reference's output bits are defined by its spec (fixed rounding points, splitmix64
    # inputs): this checksum changes only when the spec or make_workload does (then update it).
    grep -qx "reference forward checksum: aadabd271ae51b2d" "$tmp/out" ||
      fail "reference checksum differs from the spec's: $(grep checksum "$tmp/out")"
  else
    fail "building the consumer against the installed package failed"
  fi
else
  fail "configuring the consumer against the installed package failed"
fi

# 3. add_subdirectory(<source tree>): configure, then compile main.cpp only.
if run "$tmp/sub-configure.log" cmake -S "$root/tests/consumer" -B "$tmp/sub" "${consumer_args[@]}" \
       -DCMAKE_CUDA_COMPILER="$nvcc" -DMOK_SOURCE_DIR="$root"; then
  run "$tmp/sub-build.log" cmake --build "$tmp/sub" -j 2 --target CMakeFiles/mok_consumer.dir/main.cpp.o ||
    fail "compiling the consumer with add_subdirectory(mok) failed (C++20 or include path not propagated?)"
  if grep -q 'Building CUDA' "$tmp/sub-build.log"; then fail "compiling main.cpp rebuilt mok's kernels"; fi
else
  fail "configuring the consumer with add_subdirectory(mok) failed"
fi

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "all CMake package checks passed"
