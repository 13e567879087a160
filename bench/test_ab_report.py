#!/usr/bin/env python3
"""bench/ab_report.py on synthetic mok_bench results files: medians per variant, ratios to the first,
and with --base-commit the base / new medians and whether the runs' output hashes agree, for two
variants and for three (a base build, this one, an experiment)."""
import io
import json
import os
import sys
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ab_report  # noqa: E402
from report_test_util import TempDirCase  # noqa: E402


def run_file(ms, out_hash=None):
    case = {"model": "dsv3", "T": 8192, "routing": "uniform", "mok_bwd_ms": ms, "mok_ms": ms / 2}
    if out_hash:
        case["out_hash"] = [out_hash]
    return {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "date": "2026-12-07", "cases": [case]}


class AbReport(TempDirCase):
    def report(self, *args):
        out = os.path.join(self.tmp, "report.json")
        with redirect_stdout(io.StringIO()):
            ab_report.main(["--out", out, "--commit", "abc1234"] + list(args))
        with open(out) as f:
            return json.load(f)

    def variant(self, name):
        return "%s=%s" % (name, os.path.join(self.tmp, name + "_r*.json"))

    def test_three_variants_with_a_base_commit(self):
        for r, (b, n, e) in enumerate([(35.0, 30.0, 31.0), (36.0, 30.2, 30.8), (35.5, 30.1, 30.9)], 1):
            self.write("base_r%d.json" % r, run_file(b))  # an old build: no hash recorded
            self.write("new_r%d.json" % r, run_file(n, "62b07e48"))
            self.write("exp_r%d.json" % r, run_file(e, "62b07e48"))
        doc = self.report("--base-commit", "c5c4276", "--variant", self.variant("base"),
                          "--variant", self.variant("new"), "--variant", self.variant("exp"))
        c = doc["cases"][0]
        self.assertEqual(doc["variants"], ["base", "new", "exp"])
        self.assertEqual(doc["base_commit"], "c5c4276")
        self.assertEqual((c["base_ms"], c["new_ms"]), (35.5, 30.1))
        self.assertAlmostEqual(c["new_over_base"], 30.1 / 35.5)
        self.assertAlmostEqual(c["exp"]["over_base"], 30.9 / 35.5)
        self.assertEqual(c["out_hashes"], [["62b07e48"]])
        self.assertFalse(c["bitwise_same"])  # the base recorded no hash: not shown the same

    def test_two_builds_with_the_same_bits(self):
        for r in (1, 2):
            self.write("base_r%d.json" % r, run_file(10.0 + r, "aa"))
            self.write("new_r%d.json" % r, run_file(9.0 + r, "aa"))
        c = self.report("--base-commit", "c5c4276", "--field", "mok_ms", "--variant", self.variant("base"),
                        "--variant", self.variant("new"))["cases"][0]
        self.assertEqual((c["base_ms"], c["new_ms"]), (5.75, 5.25))
        self.assertTrue(c["bitwise_same"])

    def test_base_commit_needs_two_variants(self):
        self.write("base_r1.json", run_file(1.0))
        with self.assertRaises(SystemExit), redirect_stdout(io.StringIO()), \
                open(os.devnull, "w") as devnull:
            old, sys.stderr = sys.stderr, devnull
            try:
                ab_report.main(["--out", os.path.join(self.tmp, "r.json"), "--commit", "x", "--base-commit", "y",
                                "--variant", self.variant("base")])
            finally:
                sys.stderr = old


if __name__ == "__main__":
    unittest.main(verbosity=2)
