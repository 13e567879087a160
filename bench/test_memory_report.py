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


def plan_case(model, ep, layer, saved, backward, ring, worst, mode=None, workspace=0):
    total = layer + saved + backward
    case = {"model": model, "H": 64, "I": 64, "E": 8, "k": 2, "ep": ep, "T": 8192, "worst_case_rows": worst,
            "ring_rows": ring, "buffers": [],
            "totals": {"total": total, "layer": layer, "saved": saved, "backward": backward,
                       "symmetric": 0}}
    if mode is not None:  # newer planners: the mode, the workspace and the per-layer bytes
        case["mode"] = mode
        case["totals"].update(workspace=workspace, per_layer=total - workspace)
    return case


def synthetic_plan():
    return {"sm_count": 132, "cases": [
        plan_case("dsv3", 1, 3 * G, 2 * G, G // 2, ring=512, worst=512),   # ring holds the worst case
        plan_case("dsv3", 8, 10 * G, 8 * G, 2 * G, ring=256, worst=4096),  # it does not: windows
        {"model": "qwen3-30b-a3b", "ep": 8, "T": 8192, "error": "config.macrobatch_tokens: ..."},
    ]}


class MemoryReportTest(TempDirCase):

    def report(self, plan=None, mok=None, baseline=None, extra=()):
        args = [sys.executable, REPORT, "--out", os.path.join(self.tmp, "memory.json"), "--device", "NVIDIA H200",
                "--commit", "abc1234", *extra]
        if plan is not None:
            args += ["--plan-json", self.write("plan.json", plan)]
        if mok is not None:
            for i, m in enumerate(mok if isinstance(mok, list) else [mok]):
                args += ["--mok-json", self.write("mok%d.json" % i, m)]
        if baseline is not None:
            args += ["--baseline-json", self.write("baseline.json", baseline)]
        run = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(os.path.join(self.tmp, "memory.json")) as f:
            return json.load(f), run.stdout

    def case(self, doc, model, ep, routing, mode="resident"):
        got = [c for c in doc["cases"] if (c["model"], c["ep"], c["routing"], c["mode"]) == (model, ep, routing, mode)]
        self.assertEqual(len(got), 1)
        return got[0]

    def test_plan_only_invents_nothing(self):
        doc, out = self.report(synthetic_plan(), extra=["--date", "2026-01-02"])
        self.assertEqual((doc["device"], doc["date"], doc["commit"]), ("NVIDIA H200", "2026-01-02", "abc1234"))
        self.assertEqual(len(doc["cases"]), 3 * len(ROUTINGS))
        for c in doc["cases"]:
            self.assertTrue(FIELDS <= set(c), c)
            self.assertEqual((c["mode"], c["T"]), ("resident", 8192))  # the plan names no mode
            self.assertIsNone(c["measured_bytes"])
            self.assertIsNone(c["baseline_saved_bytes"])
        ep1 = self.case(doc, "dsv3", 1, "zipf")
        # persistent = scope Layer + scope Backward (no shared workspace yet), saved = scope Saved
        self.assertEqual((ep1["persistent_bytes_per_layer"], ep1["saved_bytes_per_forward"]), (3500 * 10**6, 2 * G))
        self.assertEqual(ep1["workspace_bytes"], 0)
        self.assertTrue(ep1["backward_ok"])
        self.assertTrue(self.case(doc, "dsv3", 8, "uniform")["backward_ok"])  # over windows of the ring
        # a case the planner refused: nulls, and the planner's message
        bad = self.case(doc, "qwen3-30b-a3b", 8, "one-expert")
        for k in ("workspace_bytes", "persistent_bytes_per_layer", "saved_bytes_per_forward", "backward_ok"):
            self.assertIsNone(bad[k])
        self.assertIn("macrobatch", bad["plan_error"])
        # the table and the 58-layer footprint at EP 8: (12 + 8) GB x 58 + 0
        self.assertIn("| dsv3 | 8 | resident | one-expert | 12.000 | 8.000 | 0.000 | - | - | true |", out)
        self.assertIn("| qwen3-30b-a3b | 8 | resident | zipf | - | - | - | - | - | - |", out)
        self.assertIn("dsv3 (resident): 58 layers at EP 8: 1160.000 GB", out)
        self.assertNotIn("qwen3-30b-a3b (resident): 58 layers", out)

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
        self.assertIn("| dsv3 | 1 | resident | uniform | 3.500 | 2.000 | 0.000 | - | 1.500 | true |", out)

    def test_modes_workspace_and_measurements_by_mode(self):
        plan = {"sm_count": 132, "cases": [
            plan_case("dsv3", 8, 3 * G, 2 * G, G, ring=256, worst=4096, mode="saved", workspace=2 * G),
            plan_case("dsv3", 8, 3 * G, G, G, ring=256, worst=4096, mode="recompute", workspace=2 * G)]}
        mok = {"ep": 8, "cases": [{"model": "dsv3", "T": 8192, "routing": "zipf",
                                   "memory": {"mode": "recompute", "measured_bytes": 42}}]}
        doc, out = self.report(plan, mok)
        saved = self.case(doc, "dsv3", 8, "zipf", "saved")
        # per layer = total - workspace = 4 GB, of it saved 2 GB: persistent 2 GB
        self.assertEqual((saved["persistent_bytes_per_layer"], saved["saved_bytes_per_forward"],
                          saved["workspace_bytes"]), (2 * G, 2 * G, 2 * G))
        self.assertIsNone(saved["measured_bytes"])  # measured in the other mode
        self.assertEqual(self.case(doc, "dsv3", 8, "zipf", "recompute")["measured_bytes"], 42)
        # 58 x (2 + 2) + 2 = 234 GB
        self.assertIn("dsv3 (saved): 58 layers at EP 8: 234.000 GB", out)

    def test_several_mok_files_join_each_in_its_mode(self):
        plan = {"sm_count": 132, "cases": [
            plan_case("dsv3", 1, 3 * G, 2 * G, G, ring=256, worst=4096, mode="saved", workspace=2 * G),
            plan_case("dsv3", 1, 5 * G, 2 * G, G, ring=4096, worst=4096, mode="resident")]}
        saved = {"cases": [{"model": "dsv3", "T": 8192, "routing": "uniform",
                            "memory": {"mode": "saved", "measured_bytes": 11}}]}
        resident = {"cases": [{"model": "dsv3", "T": 8192, "routing": "uniform",
                               "memory": {"mode": "resident", "measured_bytes": 22}},
                              {"model": "dsv3", "T": 8192, "routing": "zipf",
                               "memory": {"mode": "saved", "measured_bytes": 33}}]}
        doc, _ = self.report(plan, [saved, resident])
        self.assertEqual(self.case(doc, "dsv3", 1, "uniform", "saved")["measured_bytes"], 11)
        self.assertEqual(self.case(doc, "dsv3", 1, "uniform", "resident")["measured_bytes"], 22)
        self.assertEqual(self.case(doc, "dsv3", 1, "zipf", "saved")["measured_bytes"], 33)
        self.assertIsNone(self.case(doc, "dsv3", 1, "zipf", "resident")["measured_bytes"])

    @unittest.skipUnless(os.environ.get("MOK_MEMORY_PLAN"), "MOK_MEMORY_PLAN (a built mok_memory_plan) not set")
    def test_real_planner(self):
        doc, out = self.report(extra=["--plan-bin", os.environ["MOK_MEMORY_PLAN"]])
        models = {"dsv3", "qwen3-30b-a3b", "qwen3-235b"}
        modes = ("resident", "saved", "recompute")
        self.assertEqual({(c["model"], c["ep"], c["routing"], c["mode"]) for c in doc["cases"]},
                         {(m, ep, r, mode) for m in models for ep in (1, 2, 8) for r in ROUTINGS for mode in modes})
        for c in doc["cases"]:
            self.assertNotIn("plan_error", c)
            self.assertGreater(c["persistent_bytes_per_layer"], 0)
            self.assertGreater(c["saved_bytes_per_forward"], 0)
            # the planner sizes for the worst case: the same bytes for every routing
            same = self.case(doc, c["model"], c["ep"], "uniform", c["mode"])
            self.assertEqual(c["persistent_bytes_per_layer"], same["persistent_bytes_per_layer"])
            self.assertTrue(c["backward_ok"])
        for m in models:
            for mode in modes:
                self.assertIn(f"{m} ({mode}): 58 layers at EP 8", out)
        # Issue 19's bars at DeepSeek-V3, EP 8: full recompute under 1.35 GB per layer, the
        # workspace under 2 GB.
        rec = self.case(doc, "dsv3", 8, "uniform", "recompute")
        self.assertLess(rec["persistent_bytes_per_layer"] + rec["saved_bytes_per_forward"], 1.35 * G)
        self.assertLess(rec["workspace_bytes"], 2 * G)


if __name__ == "__main__":
    unittest.main()
