# Shared by the command-line tests (test_bench_cli.sh, test_gemm_bench_cli.sh), sourced: a temporary
# folder removed on exit, a failure counter, and the check that a command refuses its arguments.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
# expect_refused MESSAGE COMMAND ARGS...: exit code 2, stderr holds MESSAGE, stdout is empty (it
# stopped before running anything).
expect_refused() {
  local message="$1" rc=0 name
  shift
  name="$(basename "$1") ${*:2}"
  "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  [ "$rc" -eq 2 ] || fail "$name: exit code $rc, expected 2"
  grep -qF -- "$message" "$tmp/err" || fail "$name: stderr lacks \"$message\"; it was: $(cat "$tmp/err")"
  if [ -s "$tmp/out" ]; then fail "$name: printed to stdout (it ran?): $(head -3 "$tmp/out")"; fi
  echo "$name -> $(cat "$tmp/err")"
}
# finish WHAT: the exit status of the test.
finish() {
  if [ "$failures" -gt 0 ]; then
    echo "$failures check(s) failed" >&2
    exit 1
  fi
  echo "all $1 command-line checks passed"
}
