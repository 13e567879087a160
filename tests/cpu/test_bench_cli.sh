#!/usr/bin/env bash
# mok_bench end to end (ctest mok_bench_cli, label cpu): every bad value stops it with exit code 2
# and a message on stderr naming the option, before it runs anything (nothing on stdout); a tiny
# CPU run passes, with a note for each GPU-only option given, a PASS verdict and its results file;
# and scripts/run.sh --help prints the usage without building. Usage: test_bench_cli.sh <path to mok_bench>
set -uo pipefail
bench="$1"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tests/cpu/cli_check.sh
source "$root/tests/cpu/cli_check.sh"
expect_reject() { expect_refused "$1" "$bench" "${@:2}"; }

expect_reject "invalid argument '--ranks' (got '0'): must be a whole number in [1, 4096]" --ranks 0
expect_reject "invalid argument '--ranks' (got 'abc'): must be a whole number in [1, 4096]" --ranks abc
expect_reject "invalid argument '--threads' (got '-1'): must be a whole number in [0, 1024] (0 = all cores)" --threads -1
expect_reject "invalid argument '--reps' (got '2.5'): must be a whole number in [1, 1000]" --reps 2.5
expect_reject "invalid argument '--tokens' (got '-5'): must be a whole number in [1, 1048576] per rank" --tokens -5
expect_reject "invalid argument '--tokens' (got '12x'): must be a whole number in [1, 1048576] per rank" --tokens 12x
expect_reject "invalid argument '--sustain' (got 'x'): must be a number in [0, 600] seconds (0 = off)" --sustain x
expect_reject "invalid argument '--models' (got 'llama'): must be one of dsv3, qwen3-30b-a3b, qwen3-235b" --models dsv3,llama
expect_reject "invalid argument '--routing' (got 'zipff'): must be one of uniform, zipf" --routing zipff
expect_reject "invalid argument '--ranks' (got the option '--cpu'): needs a value" --ranks --cpu
expect_reject "invalid argument '--ranks': needs a value" --cpu --ranks
expect_reject "invalid argument '--frobnicate': unknown option (--help lists the options)" --frobnicate
expect_reject "invalid argument '--ranks': must divide the experts of preset tiny (E = 8), got 3" --cpu --preset tiny --ranks 3
# A bad value of the other mode's option is still an error (checked before the mode is known).
expect_reject "invalid argument '--comm-sms' (got '8x')" --cpu --comm-sms 8x

# A tiny CPU run: passes in well under a second, with notes for the GPU-only options, ends with
# the verdict against the fp64 model and writes its results file.
rc=0
"$bench" --cpu --preset tiny --reps 2 --threads 2 --comm-sms 8 --no-ablation --routings zipf \
  --json "$tmp/cpu.json" >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 0 ] || fail "tiny CPU run: exit code $rc: $(cat "$tmp/err")"
grep -q '^| tiny | 128 |' "$tmp/out" || fail "tiny CPU run: no results row: $(cat "$tmp/out")"
verdict="$(tail -n 2 "$tmp/out" | grep '^verdict: ' || true)"
case "$verdict" in
  "verdict: PASS — the reference engine's forward and backward match the fp64 model on 2 simulated ranks (preset tiny, uniform routing): forward rel err "*" < 1.0e-02, worst gradient "*" < 2.0e-02") ;;
  *) fail "tiny CPU run: no PASS verdict line at the end: $(tail -n 3 "$tmp/out")" ;;
esac
python3 - "$tmp/cpu.json" "$verdict" <<'PY' || fail "tiny CPU run: results file $tmp/cpu.json: see above"
import json, sys
d = json.load(open(sys.argv[1]))
want = {"device": "cpu", "gpus": 0, "preset": "tiny", "ranks": 2, "routing": "uniform", "threads": 2, "reps": 2,
        "verdict": "PASS", "verdict_line": sys.argv[2]}
bad = ["%s = %r, expected %r" % (k, d.get(k), v) for k, v in want.items() if d.get(k) != v]
for k in ("date", "commit", "what", "shape", "routed_rows", "fwd_s", "bwd_s", "fwd_s_reps", "bwd_s_reps", "fp64_check"):
    if k not in d:
        bad.append("no key " + k)
c = d.get("fp64_check", {})
if not 0 < c.get("forward_rel_err", 0) < c.get("forward_tol", 0):
    bad.append("fp64_check.forward_rel_err %r not in (0, forward_tol)" % c.get("forward_rel_err"))
if sorted(c.get("backward_rel_err", {})) != sorted(["d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down",
                                                    "d_ws_gate", "d_ws_up", "d_ws_down"]):
    bad.append("fp64_check.backward_rel_err has keys %r" % sorted(c.get("backward_rel_err", {})))
if len(d.get("fwd_s_reps", [])) != 2:
    bad.append("fwd_s_reps %r: expected one time per repetition" % d.get("fwd_s_reps"))
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
PY
for note in "note: --comm-sms applies on GPUs only; ignored in CPU mode" \
            "note: --no-ablation applies on GPUs only; ignored in CPU mode" \
            "note: --routings applies on GPUs only; ignored in CPU mode, which takes --routing"; do
  grep -qF -- "$note" "$tmp/err" || fail "tiny CPU run: stderr lacks \"$note\"; it was: $(cat "$tmp/err")"
done
echo "tiny CPU run -> $(cat "$tmp/err")"
# An unwritable results file is an error naming --json (exit code 2), after the run.
rc=0
"$bench" --cpu --preset tiny --reps 1 --json "$tmp/no-such-dir/cpu.json" >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "tiny CPU run with an unwritable --json: exit code $rc, expected 2"
grep -qF -- "'--json'" "$tmp/err" || fail "tiny CPU run with an unwritable --json: stderr lacks '--json': $(cat "$tmp/err")"

# --help: the usage file, from mok_bench and from scripts/run.sh (which must not build: its
# build folder stays absent).
"$bench" --help >"$tmp/help" || fail "mok_bench --help: nonzero exit code"
cmp -s "$tmp/help" "$root/bench/mok_bench_usage.txt" || fail "mok_bench --help differs from bench/mok_bench_usage.txt"
rc=0
MOK_BUILD="$tmp/no-build" bash "$root/scripts/run.sh" --cpu -h >"$tmp/help" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 0 ] || fail "scripts/run.sh --help: exit code $rc: $(cat "$tmp/err")"
grep -qF -- "--comm-sms N" "$tmp/help" || fail "scripts/run.sh --help lacks mok_bench's options: $(cat "$tmp/help")"
grep -qF -- "MOK_MAIN_STEP=bench" "$tmp/help" || fail "scripts/run.sh --help does not say how to split the main job"
[ ! -e "$tmp/no-build" ] || fail "scripts/run.sh --help created its build folder"
[ ! -s "$tmp/err" ] || fail "scripts/run.sh --help wrote to stderr (built?): $(cat "$tmp/err")"
# MOK_BENCH: scripts/run.sh runs that binary and builds nothing (a GPU call with prebuilt binaries).
rc=0
MOK_BUILD="$tmp/no-build" MOK_BENCH="$bench" MOK_OUT="$tmp/run-out" bash "$root/scripts/run.sh" --cpu --preset tiny \
  --reps 1 >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 0 ] || fail "MOK_BENCH=mok_bench scripts/run.sh --cpu: exit code $rc: $(cat "$tmp/err")"
[ -s "$tmp/run-out/mok-cpu.json" ] || fail "MOK_BENCH=mok_bench scripts/run.sh --cpu wrote no mok-cpu.json"
[ ! -e "$tmp/no-build" ] || fail "MOK_BENCH=mok_bench scripts/run.sh created its build folder"
rc=0
MOK_BUILD="$tmp/no-build" MOK_BENCH="$tmp/no-such-bench" bash "$root/scripts/run.sh" --cpu >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "scripts/run.sh with a missing MOK_BENCH: exit code $rc, expected 2"
grep -qF "MOK_BENCH=$tmp/no-such-bench is not an executable file" "$tmp/err" "$tmp/out" ||
  fail "scripts/run.sh with a missing MOK_BENCH: no message naming it: $(cat "$tmp/err" "$tmp/out")"

finish mok_bench
