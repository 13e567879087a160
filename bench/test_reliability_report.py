#!/usr/bin/env python3
"""Tests bench/reliability_report.py and scripts/sanitize.sh's log judging, run selection and
result assembly, without a GPU: synthetic gtest JSON (gtest 1.12's --gtest_output=json format,
taken from a real binary), synthetic sanitizer logs, and a stub compute-sanitizer.

usage: python3 bench/test_reliability_report.py   (plain unittest; pytest runs it too)
"""
import json
import os
import stat
import subprocess
import sys
import textwrap
import unittest

from report_test_util import TempDirCase

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPORT = os.path.join(HERE, "reliability_report.py")
SANITIZE = os.path.join(ROOT, "scripts", "sanitize.sh")

# What a gtest 1.12 binary writes (suite and test names changed): RecordProperty values are strings
# on the test's entry, parameterized names carry escaped slashes, a skipped test has result
# SKIPPED, a failure has a "failures" list, a disabled test has status NOTRUN.
RELIABILITY_GTEST = r"""{
  "tests": 6, "failures": 1, "disabled": 1, "errors": 0,
  "timestamp": "2026-12-01T07:59:24Z", "time": "12.5s", "name": "AllTests",
  "testsuites": [
    {
      "name": "Determinism", "tests": 1, "failures": 0, "disabled": 0, "errors": 0,
      "timestamp": "2026-12-01T07:59:24Z", "time": "9.1s",
      "testsuite": [
        {"name": "HundredForwardBackwardCallsAreBitwiseIdentical", "file": "test_reliability.cu",
         "line": 210, "status": "RUN", "result": "COMPLETED", "timestamp": "2026-12-01T07:59:24Z",
         "time": "9.1s", "classname": "Determinism", "runs": "100", "bitwise": "1"}
      ]
    },
    {
      "name": "BadRouting", "tests": 2, "failures": 1, "disabled": 0, "errors": 0,
      "timestamp": "2026-12-01T07:59:33Z", "time": "0.2s",
      "testsuite": [
        {"name": "OutOfRangeExpertIsReported", "file": "test_reliability.cu", "line": 40,
         "status": "RUN", "result": "COMPLETED", "timestamp": "2026-12-01T07:59:33Z",
         "time": "0.1s", "classname": "BadRouting"},
        {"name": "NegativeExpertIsReported", "file": "test_reliability.cu", "line": 60,
         "status": "RUN", "result": "COMPLETED", "timestamp": "2026-12-01T07:59:33Z",
         "time": "0.1s", "classname": "BadRouting",
         "failures": [{"failure": "test_reliability.cu:70\nExpected equality of these values:\n  status\n    Which is: 0\n  kBadRouting\n    Which is: 3", "type": ""}]}
      ]
    },
    {
      "name": "BadPointers", "tests": 2, "failures": 0, "disabled": 1, "errors": 0,
      "timestamp": "2026-12-01T07:59:33Z", "time": "0s",
      "testsuite": [
        {"name": "NullWeightsAreRefused", "file": "test_reliability.cu", "line": 90,
         "status": "RUN", "result": "SKIPPED", "timestamp": "2026-12-01T07:59:33Z", "time": "0s",
         "classname": "BadPointers"},
        {"name": "DISABLED_Later", "file": "test_reliability.cu", "line": 99, "status": "NOTRUN",
         "result": "SUPPRESSED", "timestamp": "1970-01-01T00:00:00Z", "time": "0s",
         "classname": "BadPointers"}
      ]
    },
    {
      "name": "Routings\/LayerForward", "tests": 1, "failures": 0, "disabled": 0, "errors": 0,
      "timestamp": "2026-12-01T07:59:33Z", "time": "3.2s",
      "testsuite": [
        {"name": "MatchesReferenceAndIsBitwiseReproducible\/ep1_uniform_shared",
         "value_param": "128-byte object <C4-91 90-6B>", "file": "test_layer.cu", "line": 300,
         "status": "RUN", "result": "COMPLETED", "timestamp": "2026-12-01T07:59:33Z",
         "time": "3.2s", "classname": "Routings\/LayerForward"}
      ]
    }
  ]
}
"""


def sanitize_doc(runs=None):
    def run(tool, test, errors, clean, rc=0, seconds=12.34):
        return {"tool": tool, "test": test, "binary": "/b/mok_gpu_layer_tests", "filter": "X.*",
                "errors": errors, "seconds": seconds, "passed_tests": 1, "failed_tests": 0,
                "rc": rc, "clean": clean}
    if runs is None:
        runs = [run("memcheck", "fwd_megakernel_pull", 0, True),
                run("racecheck", "fwd_megakernel_pull", 2, False, rc=0),
                run("synccheck", "fwd_unfused", -1, False, rc=124, seconds=240.0),
                run("initcheck", "bwd_unfused", 0, False, rc=1)]  # a test failed under the tool
    return {"device": "NVIDIA H200", "date": "2026-12-01T08:00:00Z", "commit": "c0ffee1",
            "runs": runs}


class ReportTest(TempDirCase):
    def report(self, *args):
        out = os.path.join(self.tmp, "out", "reliability.json")
        p = subprocess.run([sys.executable, REPORT, "--out", out] + list(args),
                           capture_output=True, text=True)
        return p, out

    def inputs(self, gtest=RELIABILITY_GTEST, sanitize=None):
        return ["--gtest-json", self.write("rel.json", gtest),
                "--sanitize-json", self.write("san.json", sanitize or sanitize_doc())]

    def test_full_report_has_exactly_the_shape(self):
        other = {"testsuites": [{"name": "GroupedGemm", "testsuite": [
            {"name": "Fc2ManyTiles", "status": "RUN", "result": "COMPLETED"}]}]}
        p, out = self.report(*self.inputs(), "--gtest-json", self.write("gemm.json", other),
                             "--commit", "abc1234", "--date", "2026-12-01T09:00:00Z")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(list(doc), ["device", "gpus", "date", "commit", "cases", "sanitize",
                                     "determinism"])
        self.assertEqual((doc["device"], doc["gpus"], doc["date"], doc["commit"]),
                         ("NVIDIA H200", 1, "2026-12-01T09:00:00Z", "abc1234"))
        self.assertEqual(doc["cases"], [
            {"name": "Determinism.HundredForwardBackwardCallsAreBitwiseIdentical", "passed": True},
            {"name": "BadRouting.OutOfRangeExpertIsReported", "passed": True},
            {"name": "BadRouting.NegativeExpertIsReported", "passed": False},
            {"name": "BadPointers.NullWeightsAreRefused", "passed": False, "skipped": True},
            {"name": "Routings/LayerForward.MatchesReferenceAndIsBitwiseReproducible/"
                     "ep1_uniform_shared", "passed": True},
            {"name": "GroupedGemm.Fc2ManyTiles", "passed": True}])
        self.assertEqual(doc["sanitize"], [
            {"tool": "memcheck", "test": "fwd_megakernel_pull", "errors": 0, "seconds": 12.34},
            {"tool": "racecheck", "test": "fwd_megakernel_pull", "errors": 2, "seconds": 12.34},
            {"tool": "synccheck", "test": "fwd_unfused", "errors": -1, "seconds": 240.0},
            # no error counted but not clean: must not read as "0 errors"
            {"tool": "initcheck", "test": "bwd_unfused", "errors": -1, "seconds": 12.34}])
        self.assertEqual(doc["determinism"], {"runs": 100, "bitwise": True})
        self.assertIn("BadPointers.DISABLED_Later is disabled", p.stderr)
        self.assertIn("FAILED", p.stdout)
        self.assertIn("4/6 cases passed, 1/4 sanitizer runs clean", p.stdout)

    def test_defaults_come_from_the_sanitize_json_and_the_checkout(self):
        p, out = self.report(*self.inputs(), "--gpus", "1")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(doc["device"], "NVIDIA H200")
        self.assertTrue(doc["commit"])  # git HEAD here, the sanitize JSON's without a checkout
        self.assertRegex(doc["date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")

    def test_determinism_missing_or_not_bitwise(self):
        doc = json.loads(RELIABILITY_GTEST)
        del doc["testsuites"][0]
        p, out = self.report(*self.inputs(gtest=json.dumps(doc)), "--commit", "x")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f)["determinism"], {"runs": 0, "bitwise": False})
        doc = json.loads(RELIABILITY_GTEST)
        doc["testsuites"][0]["testsuite"][0].update(runs=100, bitwise="0")  # int or string
        p, out = self.report(*self.inputs(gtest=json.dumps(doc)), "--commit", "x")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            self.assertEqual(json.load(f)["determinism"], {"runs": 100, "bitwise": False})

    def assert_refused(self, args, message):
        out = os.path.join(self.tmp, "out", "reliability.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            f.write("previous")
        p, _ = self.report(*args)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(message, p.stderr)
        self.assertIn("nothing written", p.stderr)
        with open(out) as f:
            self.assertEqual(f.read(), "previous")  # the old file is left as it was
        self.assertEqual(os.listdir(os.path.dirname(out)), ["reliability.json"])

    def test_missing_and_malformed_inputs_are_refused(self):
        san = self.write("san.json", sanitize_doc())
        self.assert_refused(["--gtest-json", os.path.join(self.tmp, "none.json"),
                             "--sanitize-json", san, "--commit", "x"], "does not exist")
        self.assert_refused(["--gtest-json", self.write("cut.json", RELIABILITY_GTEST[:300]),
                             "--sanitize-json", san, "--commit", "x"], "not readable JSON")
        self.assert_refused(["--gtest-json", self.write("ctest.json", {"tests": []}),
                             "--sanitize-json", san, "--commit", "x"], "no list 'testsuites'")
        self.assert_refused(self.inputs() + ["--sanitize-json",
                                             os.path.join(self.tmp, "nosan.json")],
                            "does not exist")
        dry = sanitize_doc()
        dry["dry_run"] = True
        self.assert_refused(self.inputs(sanitize=dry), "dry run")
        nulls = sanitize_doc()
        nulls["runs"][0]["errors"] = None
        self.assert_refused(self.inputs(sanitize=nulls), "'errors' is None")
        self.assert_refused(self.inputs(sanitize=sanitize_doc(runs=[])), "no runs")
        bad = json.loads(RELIABILITY_GTEST)
        bad["testsuites"][0]["testsuite"][0]["bitwise"] = "yes"
        self.assert_refused(self.inputs(gtest=json.dumps(bad)), "property 'bitwise'")
        nodevice = sanitize_doc()
        nodevice["device"] = "unknown"
        self.assert_refused(self.inputs(sanitize=nodevice), "pass --device")

    def test_a_test_in_two_inputs_is_refused(self):
        args = self.inputs() + ["--gtest-json", self.write("again.json", RELIABILITY_GTEST)]
        self.assert_refused(args, "is also in")

    def test_several_sanitize_files_are_joined_in_order(self):
        first = sanitize_doc()
        second = sanitize_doc([dict(first["runs"][0], tool="racecheck", test="bwd_program")])
        p, out = self.report(*self.inputs(sanitize=first),
                             "--sanitize-json", self.write("san2.json", second))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual([(s["tool"], s["test"]) for s in doc["sanitize"]],
                         [(r["tool"], r["test"]) for r in first["runs"] + second["runs"]])

    def test_sanitize_files_must_agree_and_not_repeat_a_run(self):
        again = self.inputs() + ["--sanitize-json", self.write("again.json", sanitize_doc())]
        self.assert_refused(again, "is also in")
        other = sanitize_doc([dict(sanitize_doc()["runs"][0], test="bwd_program")])
        other["commit"] = "badcafe"
        self.assert_refused(self.inputs() + ["--sanitize-json", self.write("o.json", other)],
                            "differs from the first")

    def test_reruns_are_recorded_beside_the_runs(self):
        rerun = sanitize_doc([dict(sanitize_doc()["runs"][1], errors=0, clean=True, seconds=2.5)])
        rerun["commit"] = "def5678"
        p, out = self.report(*self.inputs(), "--rerun-sanitize-json", self.write("re.json", rerun))
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(doc["sanitize"][1]["errors"], 2)  # the report commit's verdict stays
        self.assertEqual(doc["reruns"], [{"tool": "racecheck", "test": "fwd_megakernel_pull",
                                          "errors": 0, "seconds": 2.5, "commit": "def5678"}])
        self.assertIn("rerun at def5678: racecheck fwd_megakernel_pull, 0 errors", p.stdout)
        stray = sanitize_doc([dict(sanitize_doc()["runs"][0], test="bwd_program")])
        self.assert_refused(self.inputs() + ["--rerun-sanitize-json", self.write("s.json", stray)],
                            "repeats no run")
        elsewhere = dict(rerun, device="NVIDIA H100")
        self.assert_refused(self.inputs() + ["--rerun-sanitize-json", self.write("e.json", elsewhere)],
                            "differs from the report's")


# compute-sanitizer's summary lines (2024-2025 releases), inside realistic gtest output.
def log(*summary, ok=1, failed=()):
    lines = ["========= COMPUTE-SANITIZER", "Running main() from gtest_main.cc",
             "[==========] Running %d tests from 1 test suite." % (ok + len(failed))]
    lines += ["[ RUN      ] Routings/LayerForward.M/ep1_%d" % i for i in range(ok)]
    lines += ["[       OK ] Routings/LayerForward.M/ep1_%d (4210 ms)" % i for i in range(ok)]
    for name in failed:
        lines += ["[  FAILED  ] %s, where GetParam() = 128-byte object <C4-91> (88 ms)" % name]
    if failed:
        lines += ["[  FAILED  ] %d tests, listed below:" % len(failed)]
        lines += ["[  FAILED  ] %s, where GetParam() = 128-byte object <C4-91>" % n for n in failed]
        lines += ["", " %d FAILED TESTS" % len(failed)]
    return "\n".join(lines + list(summary)) + "\n"


class JudgeTest(TempDirCase):
    def judge(self, tool, text, rc=0):
        p = subprocess.run(["bash", SANITIZE, "--judge", tool, self.write("x.log", text), str(rc)],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        errors, passed, failed, clean = p.stdout.rstrip("\n").split("\t")
        return int(errors), int(passed), int(failed), clean == "true"

    def test_clean_runs(self):
        for tool in ("memcheck", "synccheck", "initcheck"):
            self.assertEqual(self.judge(tool, log("========= ERROR SUMMARY: 0 errors", ok=2)),
                             (0, 2, 0, True))
        self.assertEqual(self.judge("racecheck", log(
            "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")),
            (0, 1, 0, True))

    def test_errors_are_counted(self):
        self.assertEqual(self.judge("memcheck", log("========= ERROR SUMMARY: 1 error"), rc=0),
                         (1, 1, 0, False))
        self.assertEqual(self.judge("initcheck", log("========= ERROR SUMMARY: 10 errors")),
                         (10, 1, 0, False))
        self.assertEqual(self.judge("racecheck", log(
            "========= RACECHECK SUMMARY: 10 hazards displayed (8 errors, 2 warnings)")),
            (8, 1, 0, False))
        # warnings only: no error, but not clean (the rule is "0 hazards")
        self.assertEqual(self.judge("racecheck", log(
            "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)")),
            (0, 1, 0, False))

    def test_no_verdict(self):
        zero = "========= ERROR SUMMARY: 0 errors"
        self.assertEqual(self.judge("memcheck", log(zero), rc=124), (-1, 1, 0, False))  # timeout
        self.assertEqual(self.judge("memcheck", log(zero), rc=137), (-1, 1, 0, False))
        self.assertEqual(self.judge("memcheck", log(), rc=134), (-1, 1, 0, False))  # no summary
        self.assertEqual(self.judge("memcheck", log(zero, ok=0)), (0, 0, 0, False))  # nothing ran
        # a failed test is counted once although gtest prints it twice
        self.assertEqual(self.judge("memcheck", log(zero, failed=["Routings/LayerForward.M/x"]),
                                    rc=1), (0, 1, 1, False))
        # racecheck's verdict needs racecheck's summary, not another tool's
        self.assertEqual(self.judge("racecheck", log(zero)), (-1, 1, 0, False))
        self.assertEqual(self.judge("memcheck", "binary not found: /b/x\n", rc=127),
                         (-1, 0, 0, False))


STUB_SANITIZER = """#!/usr/bin/env bash
# compute-sanitizer stand-in: runs the binary, prints the tool's summary.
tool=memcheck
while [ $# -gt 0 ]; do
  case "$1" in --tool) tool="$2"; shift 2 ;; --report-api-errors|--print-limit) shift 2 ;;
    *) break ;; esac
done
echo "========= COMPUTE-SANITIZER"
"$@"; rc=$?
if [ "$tool" = racecheck ]; then
  echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
elif [ "$tool" = initcheck ]; then echo "========= ERROR SUMMARY: 3 errors"; exit 99
else echo "========= ERROR SUMMARY: 0 errors"; fi
exit $rc
"""
# A gtest binary stand-in: the unfused test hangs under racecheck's stub (a timeout).
STUB_TEST = """#!/usr/bin/env bash
filter="${1#--gtest_filter=}"
[ "$MOK_TEST_WAIT_TIMEOUT_S" = 120 ] || { echo "wait bound not exported"; exit 3; }
case "$filter" in *unfused*) [ -n "$STUB_HANG" ] && sleep 30 ;; esac
echo "[ RUN      ] $filter"
echo "[       OK ] $filter (5 ms)"
"""


class SanitizeScriptTest(TempDirCase):
    def sanitize(self, **env):
        full = dict(os.environ, OUT=os.path.join(self.tmp, "out"), MOK_COMMIT="c0ffee1",
                    MOK_BUILD=os.path.join(self.tmp, "build"))
        full.update(env)
        return subprocess.run(["bash", SANITIZE], capture_output=True, text=True, env=full,
                              timeout=120)

    def result(self):
        with open(os.path.join(self.tmp, "out", "sanitize.json")) as f:
            return json.load(f)

    def test_dry_run_selects_every_run_in_a_fixed_order(self):
        p = self.sanitize(MOK_SANITIZE_DRY_RUN="1")
        self.assertEqual(p.returncode, 0, p.stderr)
        doc = self.result()
        self.assertTrue(doc["dry_run"])
        self.assertEqual(doc["commit"], "c0ffee1")
        runs = [(r["tool"], r["test"]) for r in doc["runs"]]
        self.assertEqual(len(runs), 13 * 4 + 2 + 2 + 2 + 3)  # 4-tool cases, gemm, fp8_gemm, fp8_backward, fp8_quantize
        self.assertEqual(runs[:5], [("memcheck", "fwd_megakernel_pull"),
                                    ("racecheck", "fwd_megakernel_pull"),
                                    ("synccheck", "fwd_megakernel_pull"),
                                    ("initcheck", "fwd_megakernel_pull"),
                                    ("memcheck", "fwd_megakernel_ring")])
        self.assertEqual(runs[-9:], [("memcheck", "gemm"), ("racecheck", "gemm"), ("memcheck", "fp8_gemm"),
                                     ("racecheck", "fp8_gemm"), ("memcheck", "fp8_backward"),
                                     ("racecheck", "fp8_backward"), ("memcheck", "fp8_quantize"),
                                     ("racecheck", "fp8_quantize"), ("initcheck", "fp8_quantize")])
        self.assertTrue(all(r["errors"] is None and not r["clean"] for r in doc["runs"]))
        self.assertIn("--gtest_filter=Paths/BadRouting.\\*:BadRoutingBackward.\\*:Faults/BadPointers.\\*", p.stdout)
        self.assertIn("mok_gpu_reliability_tests", p.stderr)  # would build it

    def test_dry_run_subsets(self):
        p = self.sanitize(MOK_SANITIZE_DRY_RUN="1", MOK_SANITIZE_TOOLS="initcheck racecheck",
                          MOK_SANITIZE_ONLY="^(bwd_|gemm)")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual([(r["tool"], r["test"]) for r in self.result()["runs"]], [
            ("initcheck", "bwd_unfused"), ("racecheck", "bwd_unfused"),
            ("initcheck", "bwd_after_megakernel"), ("racecheck", "bwd_after_megakernel"),
            ("initcheck", "bwd_windows"), ("racecheck", "bwd_windows_uniform"),
            ("initcheck", "bwd_saved_forwards"), ("racecheck", "bwd_saved_forwards"),
            ("initcheck", "bwd_program"), ("racecheck", "bwd_program"), ("racecheck", "gemm")])
        self.assertEqual(self.sanitize(MOK_SANITIZE_DRY_RUN="1", MOK_SANITIZE_ONLY="nothing")
                         .returncode, 2)
        self.assertEqual(self.sanitize(MOK_SANITIZE_DRY_RUN="1", MOK_SANITIZE_TOOLS="memchek")
                         .returncode, 2)

    def test_stub_runs_are_judged_and_ordered(self):
        stubs = os.path.join(self.tmp, "bin")
        layer = os.path.join(self.tmp, "build", "tests", "gpu", "megakernel")
        os.makedirs(stubs)
        os.makedirs(layer)
        for path, text in ((os.path.join(stubs, "compute-sanitizer"), STUB_SANITIZER),
                           (os.path.join(layer, "mok_gpu_layer_tests"), STUB_TEST)):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        # the reliability binary is missing: its runs fail, the others still run
        p = self.sanitize(MOK_SANITIZE_NO_BUILD="1", PATH=stubs + os.pathsep + os.environ["PATH"],
                          MOK_SANITIZE_ONLY="^(fwd_megakernel_pull|fwd_unfused|reliability)$",
                          MOK_SANITIZE_TOOLS="racecheck memcheck initcheck", MOK_SANITIZE_JOBS="2",
                          MOK_SANITIZE_TIMEOUT_S="2", STUB_HANG="1")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        got = [(r["tool"], r["test"], r["errors"], r["rc"], r["passed_tests"], r["clean"])
               for r in self.result()["runs"]]
        self.assertEqual(got, [
            ("racecheck", "fwd_megakernel_pull", 0, 0, 1, True),
            ("memcheck", "fwd_megakernel_pull", 0, 0, 1, True),
            ("initcheck", "fwd_megakernel_pull", 3, 99, 1, False),
            ("racecheck", "fwd_unfused", -1, 124, 0, False),  # hung: stopped by the timeout
            ("memcheck", "fwd_unfused", -1, 124, 0, False),
            ("initcheck", "fwd_unfused", -1, 124, 0, False),
            ("racecheck", "reliability", -1, 127, 0, False),  # binary not found
            ("memcheck", "reliability", -1, 127, 0, False),
            ("initcheck", "reliability", -1, 127, 0, False)])
        out = os.path.join(self.tmp, "out")
        self.assertTrue(os.path.isfile(os.path.join(out, "racecheck-fwd_megakernel_pull.log")))
        with open(os.path.join(out, "memcheck-reliability.log")) as f:
            self.assertIn("binary not found", f.read())
        self.assertIn("NOT CLEAN", p.stdout)
        self.assertEqual(sorted(f for f in os.listdir(out) if not f.endswith(".log")),
                         ["sanitize.json"])
        # and the report takes it
        gtest = self.write("rel.json", RELIABILITY_GTEST)
        doc = self.result()
        doc["device"] = "NVIDIA H200"
        san = self.write("san.json", doc)
        rep = os.path.join(self.tmp, "rel-report.json")
        r = subprocess.run([sys.executable, REPORT, "--gtest-json", gtest, "--sanitize-json", san,
                            "--out", rep, "--commit", "c0ffee1"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(rep) as f:
            self.assertEqual([s["errors"] for s in json.load(f)["sanitize"]],
                             [0, 0, 3, -1, -1, -1, -1, -1, -1])


if __name__ == "__main__":
    unittest.main()
