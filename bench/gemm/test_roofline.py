#!/usr/bin/env python3
"""Self-test of bench/gemm/roofline.py and make_json.py's roofline fields (synthetic inputs)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from roofline import roofline_tflops  # noqa: E402


def fc1_case(rows_per_expert, experts=32, n=4096, k=7168):
    rows = rows_per_expert * experts
    return {"name": "dsv3-fc1", "form": "fc1", "rows_per_expert": rows_per_expert, "routing": "uniform",
            "experts": experts, "n": n, "k": k, "m": rows, "flops": 2.0 * rows * n * k}


class Roofline(unittest.TestCase):
    def test_memory_bound_case_by_hand(self):
        c = fc1_case(128)
        rows = 128 * 32
        nbytes = 2.0 * (32 * 4096 * 7168 + rows * 7168 + rows * 4096)
        want = c["flops"] / (nbytes / 4.3e12) / 1e12
        self.assertAlmostEqual(roofline_tflops(c, c["flops"], 780.0, 4.3), want, places=6)
        self.assertLess(want, 780.0)  # 128 rows per expert: below the memory ridge

    def test_large_case_is_compute_bound(self):
        c = fc1_case(2048)
        self.assertEqual(roofline_tflops(c, c["flops"], 780.0, 4.3), 780.0)

    def test_no_model_for_wgrad_or_missing_inputs(self):
        c = dict(fc1_case(512), form="wgrad")
        self.assertIsNone(roofline_tflops(c, c["flops"], 780.0, 4.3))
        self.assertIsNone(roofline_tflops(dict(c, k=0), c["flops"], 780.0, 4.3))  # no division by 0
        self.assertIsNone(roofline_tflops(dict(fc1_case(512), k=0), 1e12, 780.0, 4.3))
        self.assertIsNone(roofline_tflops(fc1_case(512), None, 780.0, 4.3))
        self.assertIsNone(roofline_tflops(fc1_case(512), 1e12, 780.0, 0.0))

    def test_make_json_writes_roofline_fields(self):
        c = dict(fc1_case(128), mok_ms=0.5, check_rel_err=1e-3)
        c["mok_tflops"] = c["flops"] / 0.5e-3 / 1e12
        tor = {"peak_bf16_tflops": 780.0, "copy_tbps": 4.0,
               "cases": [{"name": "dsv3-fc1", "form": "fc1", "rows_per_expert": 128, "routing": "uniform",
                          "torch_ms": 0.6}]}
        with tempfile.TemporaryDirectory() as d:
            paths = [os.path.join(d, f) for f in ("m.json", "t.json", "o.json")]
            json.dump({"device": "X", "cases": [c]}, open(paths[0], "w"))
            json.dump(tor, open(paths[1], "w"))
            subprocess.run([sys.executable, os.path.join(HERE, "make_json.py"), "--mok", paths[0], "--torch",
                            paths[1], "--out", paths[2], "--commit", "x"], check=True, capture_output=True)
            out = json.load(open(paths[2]))
            self.assertEqual(out["copy_tbps"], 4.0)
            want = roofline_tflops(c, c["flops"], 780.0, 4.0)
            self.assertAlmostEqual(out["cases"][0]["roofline_tflops"], round(want, 1))
            table = subprocess.run([sys.executable, os.path.join(HERE, "roofline.py"), paths[2]], check=True,
                                   capture_output=True, text=True).stdout
            self.assertIn("above the copy-rate roof", table)  # bar 1.25 x torch: over the copy-based roof


if __name__ == "__main__":
    unittest.main()
