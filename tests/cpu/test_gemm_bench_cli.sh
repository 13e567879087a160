#!/usr/bin/env bash
# The GEMM benchmarks' command lines (ctest gemm_bench_cli, label cpu): a bad number stops each with
# exit code 2 and a message naming the option, before it touches the GPU (so this runs on a
# machine without one). Usage: test_gemm_bench_cli.sh <mok_gemm_bench> <mok_read_ceiling> <mok_fp8_backward_bench>
set -uo pipefail
gemm="$1" ceiling="$2" fp8bwd="$3"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
# expect_reject MESSAGE BINARY ARGS...: exit code 2 and MESSAGE on stderr.
expect_reject() {
  local message="$1" bin="$2" rc=0
  shift 2
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  [ "$rc" -eq 2 ] || fail "$(basename "$bin") $*: exit code $rc, expected 2"
  grep -qF -- "$message" "$tmp/err" || fail "$(basename "$bin") $*: stderr lacks \"$message\"; it was: $(cat "$tmp/err")"
  echo "$(basename "$bin") $* -> $(cat "$tmp/err")"
}
expect_reject "invalid argument '--reps' (got '0'): must be a whole number in [1, 100000]" "$gemm" --reps 0
expect_reject "invalid argument '--block-n' (got '2.5'): must be a whole number in [0, 256] (0, 128 or 256)" "$gemm" --block-n 2.5
expect_reject "invalid argument '--skew' (got '-2'): must be a whole number in [-1, 64]" "$gemm" --skew -2
expect_reject "invalid argument '--pdl' (got 'yes'): must be a whole number in [0, 1]" "$gemm" --pdl yes
expect_reject "usage:" "$gemm" --frobnicate
expect_reject "invalid argument '--reps' (got '2'): must be a whole number in [3, 100000]" "$ceiling" --reps 2
expect_reject "invalid argument '--gib' (got 'nan'): must be a number in [0.5, 64]" "$ceiling" --gib nan
expect_reject "invalid argument '--reps' (got 'abc'): must be a whole number in [1, 100000]" "$fp8bwd" --reps abc
expect_reject "usage:" "$fp8bwd" --out
if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all GEMM benchmark command-line checks passed"
