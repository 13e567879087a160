#!/usr/bin/env bash
# The scripts that run on the GPU machine must not fail there on a syntax error or a missing
# argument (a device call is minutes of a budget of 30): every shell script of bench/, scripts/
# and tools/ parses (bash -n), bench/gemm/ab_device.sh without its base tarball stops at once,
# naming BASE_TAR, before building anything, bench/knobs_ab.sh runs its variants as asked and
# scripts/ep_device.sh its steps (below).   Usage: test_device_scripts.sh REPO_ROOT
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

# bench/knobs_ab.sh with a stand-in for mok_bench (BENCH): each variant's environment knobs and
# mok_bench options reach its runs, NAME: alone runs the defaults, the runs alternate, and the
# joined report has every run under its variant; bad settings stop it (exit 2) before any run.
cat >"$tmp/bench" <<'STAND_IN'
#!/usr/bin/env bash
# Writes a results file whose mok_ms is 1 + comm SMs / 100 + KNOB / 1000 (so the report can be checked).
json="" sms=0 prev=""
for a in "$@"; do
  [ "$prev" = --json ] && json="$a"
  [ "$prev" = --comm-sms ] && sms="$a"
  prev="$a"
done
echo "$*" >>"$(dirname "$json")/argv.log"
python3 -c "import json, sys; json.dump({'device': 'stand-in', 'gpus': 1, 'date': 'd', 'cases': [{'model': 'm', 'T': 8192, 'routing': 'uniform', 'mok_ms': 1 + int(sys.argv[2]) / 100 + int(sys.argv[3]) / 1000}]}, open(sys.argv[1], 'w'))" "$json" "$sms" "${KNOB:-0}"
STAND_IN
chmod +x "$tmp/bench"
if OUT="$tmp/kab" BENCH="$tmp/bench" VARIANTS="base: c16:--comm-sms=16,KNOB=3" FIELD=mok_ms EXTRA=--no-backward \
    ROUNDS=2 MOK_COMMIT=abc bash "$root/bench/knobs_ab.sh" >"$tmp/kab.out" 2>&1; then
  python3 - "$tmp/kab/knobs-ab.json" <<'CHECK' || fail "knobs_ab.sh: the joined report is wrong: $(cat "$tmp/kab.out")"
import json, sys
d = json.load(open(sys.argv[1]))
c = d["cases"][0]
assert d["variants"] == ["base", "c16"] and d["commit"] == "abc", d
assert c["base"]["runs"] == [1.0, 1.0], c
assert len(c["c16"]["runs"]) == 2 and all(abs(r - 1.163) < 1e-9 for r in c["c16"]["runs"]), c  # KNOB=3 too
assert abs(c["c16"]["over_base"] - 1.163) < 1e-9, c
CHECK
  order="$(grep -o -- '--comm-sms 16' "$tmp/kab/argv.log" | wc -l) $(grep -c -- '--no-backward' "$tmp/kab/argv.log")"
  [ "$order" = "2 4" ] || fail "knobs_ab.sh: expected 2 runs with --comm-sms 16 and 4 with --no-backward, got $order"
else
  fail "knobs_ab.sh with a stand-in bench failed: $(cat "$tmp/kab.out")"
fi
# Two builds alternated (a variant's BENCH= item) with BASE_COMMIT: the report's base_ms / new_ms.
cp "$tmp/bench" "$tmp/bench_base"
if OUT="$tmp/kab3" BENCH="$tmp/bench" VARIANTS="base:BENCH=$tmp/bench_base,--comm-sms=10 new:" FIELD=mok_ms \
    BASE_COMMIT=b0 ROUNDS=1 bash "$root/bench/knobs_ab.sh" >"$tmp/kab3.out" 2>&1; then
  python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['cases'][0]; assert abs(c['base_ms'] - 1.1) < 1e-9 and c['new_ms'] == 1.0, c" \
    "$tmp/kab3/knobs-ab.json" || fail "knobs_ab.sh: the two-build report is wrong"
else
  fail "knobs_ab.sh with two builds failed: $(cat "$tmp/kab3.out")"
fi
OUT="$tmp/kab2" BENCH="$tmp/bench" VARIANTS="a:BENCH=$tmp/missing" expect_refused "is not an executable" bash "$root/bench/knobs_ab.sh"
OUT="$tmp/kab2" BENCH="$tmp/bench" VARIANTS="nocolon" expect_refused "variant 'nocolon'" bash "$root/bench/knobs_ab.sh"
OUT="$tmp/kab2" BENCH="$tmp/bench" VARIANTS="a:" ROUNDS=0 expect_refused "ROUNDS" bash "$root/bench/knobs_ab.sh"
OUT="$tmp/kab2" BENCH="$tmp/missing" VARIANTS="a:" expect_refused "BENCH" bash "$root/bench/knobs_ab.sh"
OUT="$tmp/kab2" VARIANTS="" expect_refused "set VARIANTS" bash "$root/bench/knobs_ab.sh"

# scripts/ep_device.sh (the multi-GPU call) in its dry run: the steps asked for, in order, with the
# prebuilt binaries (the main job through run.sh's MOK_BENCH, the knobs through knobs_ab.sh's BENCH);
# bad settings stop it (exit 2).
if OUT="$tmp/ep" EP_DRY_RUN=1 EP_STEPS="main knobs windows" bash "$root/scripts/ep_device.sh" >"$tmp/ep.out" 2>&1; then
  grep -q '^main: env MOK_BENCH=devrun/bin/mok_bench .*scripts/run.sh --tokens 8192 --routings uniform --no-ablation$' "$tmp/ep/summary.txt" ||
    fail "ep_device.sh: the main step is not run.sh with the prebuilt mok_bench: $(cat "$tmp/ep/summary.txt")"
  grep -q '^knobs: env BENCH=devrun/bin/mok_bench .*MOK_BWD_PULL_AHEAD=0.*bench/knobs_ab.sh$' "$tmp/ep/summary.txt" ||
    fail "ep_device.sh: the knobs step is not knobs_ab.sh: $(cat "$tmp/ep/summary.txt")"
  grep -q '^windows: env BENCH=devrun/bin/mok_bench .*MOK_BWD_SYNC_WINDOWS=2.*MOK_BWD_SYNC_WINDOWS=1.*bench/knobs_ab.sh$' "$tmp/ep/summary.txt" ||
    fail "ep_device.sh: the windows step is not knobs_ab.sh with the sync-windows knob: $(cat "$tmp/ep/summary.txt")"
  [ "$(cut -d: -f1 "$tmp/ep/summary.txt" | tr '\n' ' ')" = "main knobs windows " ] ||
    fail "ep_device.sh: steps other than those asked for: $(cat "$tmp/ep/summary.txt")"
else
  fail "ep_device.sh dry run failed: $(cat "$tmp/ep.out")"
fi
OUT="$tmp/ep2" EP_DRY_RUN=1 EP_STEPS="main bogus" expect_refused "unknown step 'bogus'" bash "$root/scripts/ep_device.sh"
OUT="$tmp/ep2" EP_DRY_RUN=1 EP_BUDGET_S=10m expect_refused "EP_BUDGET_S" bash "$root/scripts/ep_device.sh"
finish "device-script"
