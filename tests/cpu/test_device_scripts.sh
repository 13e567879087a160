#!/usr/bin/env bash
# The scripts that run on the GPU machine must not fail there on a syntax error or a missing
# argument (a device call is minutes of a budget of 30): every shell script of bench/, scripts/
# and tools/ parses (bash -n), and bench/gemm/ab_device.sh without its base tarball stops at once,
# naming BASE_TAR, before building anything.   Usage: test_device_scripts.sh REPO_ROOT
set -uo pipefail
root="$1"
# shellcheck source=tests/cpu/cli_check.sh
. "$(dirname "${BASH_SOURCE[0]}")/cli_check.sh"
count=0
while IFS= read -r -d '' f; do
  count=$((count + 1))
  bash -n "$f" 2>"$tmp/err" || fail "$f does not parse: $(cat "$tmp/err")"
done < <(find "$root/bench" "$root/scripts" "$root/tools" -name '*.sh' -print0)
[ "$count" -ge 10 ] || fail "found only $count scripts under bench/, scripts/, tools/"
echo "$count scripts parse"
OUT="$tmp/ab" BASE_TAR="" expect_refused "BASE_TAR" bash "$root/bench/gemm/ab_device.sh"
OUT="$tmp/ab" BASE_TAR="$tmp/missing.tar" expect_refused "not found" bash "$root/bench/gemm/ab_device.sh"
finish "device-script"
