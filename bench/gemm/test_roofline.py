#!/usr/bin/env python3
"""Self-test of bench/gemm/roofline.py, make_json.py's roofline fields and plot_gemm.py (synthetic inputs)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from roofline import read_bound_tflops, roofline_tflops  # noqa: E402


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

    def test_dgrad_swiglu_reads_gu_and_writes_d_gu(self):
        rows, e, n, k = 128 * 32, 32, 2048, 7168
        c = {"name": "dsv3-dgrad-fc2-swiglu", "form": "dgrad_swiglu", "rows_per_expert": 128, "routing": "uniform",
             "experts": e, "n": n, "k": k, "m": 0, "flops": 2.0 * rows * n * k}
        nbytes = 2.0 * (e * n * k + rows * k + 4 * rows * n)
        self.assertAlmostEqual(roofline_tflops(c, c["flops"], 780.0, 4.3), c["flops"] / (nbytes / 4.3e12) / 1e12,
                               places=6)

    def test_read_bound_counts_weights_and_inputs_only(self):
        c = fc1_case(128)
        rows = 128 * 32
        nbytes = 2.0 * (32 * 4096 * 7168 + rows * 7168)  # no output bytes
        self.assertAlmostEqual(read_bound_tflops(c, c["flops"], 4.0), c["flops"] / (nbytes / 4.0e12) / 1e12,
                               places=6)
        d = dict(c, form="dgrad_swiglu", n=2048)
        flops = 2.0 * rows * 2048 * 7168
        nbytes = 2.0 * (32 * 2048 * 7168 + rows * 7168 + 2 * rows * 2048)  # + gu, 2n wide
        self.assertAlmostEqual(read_bound_tflops(d, flops, 4.0), flops / (nbytes / 4.0e12) / 1e12, places=6)
        self.assertIsNone(read_bound_tflops(dict(c, form="wgrad"), c["flops"], 4.0))
        self.assertIsNone(read_bound_tflops(c, c["flops"], None))

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
            self.assertNotIn("read_tbps", out)  # no --read: no read ceiling claimed

            # With a read ceiling low enough that the bar needs a faster read stream.
            json.dump({"read_tbps": 3.0, "best": "tma x"}, open(os.path.join(d, "r.json"), "w"))
            subprocess.run([sys.executable, os.path.join(HERE, "make_json.py"), "--mok", paths[0], "--torch",
                            paths[1], "--out", paths[2], "--commit", "x", "--read", os.path.join(d, "r.json")],
                           check=True, capture_output=True)
            out = json.load(open(paths[2]))
            self.assertEqual(out["read_tbps"], 3.0)
            self.assertAlmostEqual(out["cases"][0]["read_bound_tflops"],
                                   round(read_bound_tflops(c, c["flops"], 3.0), 1))
            table = subprocess.run([sys.executable, os.path.join(HERE, "roofline.py"), paths[2]], check=True,
                                   capture_output=True, text=True).stdout
            self.assertIn("ABOVE the measured read ceiling", table)


class Plot(unittest.TestCase):
    def test_plot_writes_a_png(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib not installed")
        cases = []
        for rows in (128, 512):
            for form in ("fc1", "dgrad"):
                c = dict(fc1_case(rows), form=form, name=f"dsv3-{form}", mok_ms=1.0, speedup=1.1,
                         torch_grouped_mm_tflops=400.0)
                c["mok_tflops"] = c["flops"] / 1e-3 / 1e12
                cases.append(c)
        doc = {"device": "X", "commit": "abc", "date": "2026-11-30", "peak_bf16_tflops": 780.0,
               "copy_tbps": 4.3, "cases": cases}
        with tempfile.TemporaryDirectory() as d:
            src, png = os.path.join(d, "g.json"), os.path.join(d, "g.png")
            json.dump(doc, open(src, "w"))
            subprocess.run([sys.executable, os.path.join(HERE, "plot_gemm.py"), src, png], check=True,
                           capture_output=True)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            empty = os.path.join(d, "e.json")
            json.dump({"cases": []}, open(empty, "w"))
            r = subprocess.run([sys.executable, os.path.join(HERE, "plot_gemm.py"), empty, png], capture_output=True)
            self.assertEqual(r.returncode, 1)  # nothing to plot is an error, not an empty figure


if __name__ == "__main__":
    unittest.main()
