#!/usr/bin/env python3
"""Tests memory_report.py on synthetic plan, mok_bench and baseline files (CPU only).

usage: python3 bench/test_memory_report.py   (plain unittest; pytest collects it too). With
MOK_MEMORY_PLAN set to a built mok_memory_plan (ctest sets it), the real planner's output is
checked end to end as well; otherwise that test is skipped.
"""
import json
import os
import subprocess
import sys
import unittest

from report_test_util import TempDirCase

HERE = os.path.dirname(os.path.abspath(__file__))
REPORT = os.path.join(HERE, "memory_report.py")
ROUTINGS = ["uniform", "zipf", "one-expert"]
G = 10**9
FIELDS = {"model", "ep", "T", "routing", "mode", "workspace_bytes", "persistent_bytes_per_layer",
          "saved_bytes_per_forward", "baseline_saved_bytes", "measured_bytes", "backward_ok"}


def plan_case(model, ep, layer, saved, backward, ring, worst):
    return {"model": model, "H": 64, "I": 64, "E": 8, "k": 2, "ep": ep, "T": 8192, "worst_case_rows": worst,
            "ring_rows": ring, "buffers": [],
            "totals": {"total": layer + saved + backward, "layer": layer, "saved": saved, "backward": backward,
                       "symmetric": 0}}


def synthetic_plan():
    return {"sm_count": 132, "cases": [
        plan_case("dsv3", 1, 3 * G, 2 * G, G // 2, ring=512, worst=512),   # ring holds the worst case
        plan_case("dsv3", 8, 10 * G, 8 * G, 2 * G, ring=256, worst=4096),  # it does not
        {"model": "qwen3-30b-a3b", "ep": 8, "T": 8192, "error": "config.macrobatch_tokens: ..."},
    ]}


class MemoryReportTest(TempDirCase):

    def report(self, plan=None, mok=None, baseline=None, extra=()):
        args = [sys.executable, REPORT, "--out", os.path.join(self.tmp, "memory.json"), "--device", "NVIDIA H200",
                "--commit", "abc1234", *extra]
        if plan is not None:
            args += ["--plan-json", self.write("plan.json", plan)]
        if mok is not None:
            args += ["--mok-json", self.write("mok.json", mok)]
        if baseline is not None:
            args += ["--baseline-json", self.write("baseline.json", baseline)]
        run = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(os.path.join(self.tmp, "memory.json")) as f:
            return json.load(f), run.stdout

    def case(self, doc, model, ep, routing):
        got = [c for c in doc["cases"] if (c["model"], c["ep"], c["routing"]) == (model, ep, routing)]
        self.assertEqual(len(got), 1)
        return got[0]

    def test_plan_only_invents_nothing(self):
        doc, out = self.report(synthetic_plan(), extra=["--date", "2026-01-02"])
        self.assertEqual((doc["device"], doc["date"], doc["commit"]), ("NVIDIA H200", "2026-01-02", "abc1234"))
        self.assertEqual(len(doc["cases"]), 3 * len(ROUTINGS))
        for c in doc["cases"]:
            self.assertTrue(FIELDS <= set(c), c)
            self.assertEqual((c["mode"], c["T"]), ("saved", 8192))
            self.assertIsNone(c["measured_bytes"])
            self.assertIsNone(c["baseline_saved_bytes"])
        ep1 = self.case(doc, "dsv3", 1, "zipf")
        # persistent = scope Layer + scope Backward (no shared workspace yet), saved = scope Saved
        self.assertEqual((ep1["persistent_bytes_per_layer"], ep1["saved_bytes_per_forward"]), (3500 * 10**6, 2 * G))
        self.assertEqual(ep1["workspace_bytes"], 0)
        self.assertTrue(ep1["backward_ok"])
        self.assertFalse(self.case(doc, "dsv3", 8, "uniform")["backward_ok"])
        # a case the planner refused: nulls, and the planner's message
        bad = self.case(doc, "qwen3-30b-a3b", 8, "one-expert")
        for k in ("workspace_bytes", "persistent_bytes_per_layer", "saved_bytes_per_forward", "backward_ok"):
            self.assertIsNone(bad[k])
        self.assertIn("macrobatch", bad["plan_error"])
        # the table and the 58-layer footprint at EP 8: (12 + 8) GB x 58 + 0
        self.assertIn("| dsv3 | 8 | one-expert | 12.000 | 8.000 | 0.000 | - | - | false |", out)
        self.assertIn("| qwen3-30b-a3b | 8 | zipf | - | - | - | - | - | - |", out)
        self.assertIn("dsv3: 58 layers at EP 8: 1160.000 GB", out)
        self.assertNotIn("qwen3-30b-a3b: 58 layers", out)

    def test_measurements_join_exactly(self):
        mok = {"ep": 1, "cases": [
            {"model": "dsv3", "T": 8192, "routing": "uniform", "variant": "megakernel",
             "memory": {"total_bytes": 1, "measured_bytes": 1500 * 10**6}},
            {"model": "dsv3", "T": 8192, "routing": "zipf", "memory": {"total_bytes": 1}},  # not measured
            {"model": "dsv3", "T": 8192, "routing": "one-expert", "variant": "unfused",
             "memory": {"measured_bytes": 9}},  # another path: not the plan's
            {"model": "dsv3/ep8", "T": 8192, "routing": "uniform", "memory": {"measured_bytes": 8}},  # a slice
            {"model": "dsv3", "T": 2048, "routing": "uniform", "memory": {"measured_bytes": 7}}]}  # another T
        base = {"cases": [{"model": "dsv3", "T": 8192, "routing": "zipf", "saved_bytes": 2222 * 10**6, "ep": 1},
                          {"model": "dsv3", "T": 8192, "routing": "uniform", "saved_bytes": 3333 * 10**6, "ep": 8},
                          {"model": "dsv3", "T": 8192, "routing": "one-expert", "baseline_ms": 1.0}]}
        doc, out = self.report(synthetic_plan(), mok, base)
        self.assertEqual(self.case(doc, "dsv3", 1, "uniform")["measured_bytes"], 1500 * 10**6)
        self.assertEqual(self.case(doc, "dsv3", 1, "zipf")["baseline_saved_bytes"], 2222 * 10**6)
        self.assertEqual(self.case(doc, "dsv3", 8, "uniform")["baseline_saved_bytes"], 3333 * 10**6)
        joined = {(1, "uniform", "measured_bytes"), (1, "zipf", "baseline_saved_bytes"),
                  (8, "uniform", "baseline_saved_bytes")}
        for c in doc["cases"]:
            for k in ("measured_bytes", "baseline_saved_bytes"):
                if (c["model"], c["ep"], c["routing"], k) not in {("dsv3",) + j for j in joined}:
                    self.assertIsNone(c[k], (c, k))
        self.assertIn("| dsv3 | 1 | uniform | 3.500 | 2.000 | 0.000 | - | 1.500 | true |", out)

    @unittest.skipUnless(os.environ.get("MOK_MEMORY_PLAN"), "MOK_MEMORY_PLAN (a built mok_memory_plan) not set")
    def test_real_planner(self):
        doc, out = self.report(extra=["--plan-bin", os.environ["MOK_MEMORY_PLAN"]])
        models = {"dsv3", "qwen3-30b-a3b", "qwen3-235b"}
        self.assertEqual({(c["model"], c["ep"], c["routing"]) for c in doc["cases"]},
                         {(m, ep, r) for m in models for ep in (1, 2, 8) for r in ROUTINGS})
        for c in doc["cases"]:
            self.assertNotIn("plan_error", c)
            self.assertGreater(c["persistent_bytes_per_layer"], 0)
            self.assertGreater(c["saved_bytes_per_forward"], 0)
            # the planner sizes for the worst case: the same bytes for every routing
            same = self.case(doc, c["model"], c["ep"], "uniform")
            self.assertEqual(c["persistent_bytes_per_layer"], same["persistent_bytes_per_layer"])
        for m in models:
            self.assertIn(f"{m}: 58 layers at EP 8", out)


if __name__ == "__main__":
    unittest.main()
