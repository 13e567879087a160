#!/usr/bin/env python3
"""Tests forward_report.py and plot_forward.py on synthetic results files.

usage: python3 bench/test_forward_report.py   (plain unittest; the plot tests are skipped when
matplotlib is not installed)
"""
import importlib.util
import json
import os
import subprocess
import sys
import unittest

from report_test_util import TempDirCase

HERE = os.path.dirname(os.path.abspath(__file__))
REPORT = os.path.join(HERE, "forward_report.py")
PLOT = os.path.join(HERE, "plot_forward.py")
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def mok_case(model, t, routing, ms, comm_sms=16, minibatch=1920):
    return {"model": model, "T": t, "routing": routing, "variant": "megakernel", "mok_ms": ms,
            "mok_tflops": 1000.0 / ms, "comm_sms": comm_sms, "minibatch_tokens": minibatch,
            "check_rel_err": 0.001}


def ablation_entry(model, t, routing, variant, comm_sms, minibatch, ms, macrobatch=8192):
    return {"model": model, "T": t, "routing": routing, "variant": variant, "comm_sms": comm_sms,
            "minibatch_tokens": minibatch, "macrobatch_tokens": macrobatch, "ms": ms,
            "tflops": 1000.0 / ms}


def synthetic_mok(with_ablation=True):
    doc = {"device": "NVIDIA H200", "gpus": 2, "date": "2026-12-01T00:00:00Z", "commit": "abc1234",
           "ep": 2, "what": "mok forward (synthetic)",
           "cases": [mok_case("dsv3", 2048, "uniform", 4.0),
                     mok_case("qwen3-30b-a3b", 8192, "zipf", 2.0, minibatch=4992)]}
    if with_ablation:
        doc["ablation"] = [
            # dsv3: a comm SM sweep and a minibatch sweep of the megakernel, plus the unfused path
            ablation_entry("dsv3", 2048, "uniform", "megakernel", 8, 1920, 5.0),
            ablation_entry("dsv3", 2048, "uniform", "megakernel", 16, 1920, 4.0),
            ablation_entry("dsv3", 2048, "uniform", "megakernel", 24, 1920, 4.5),
            ablation_entry("dsv3", 2048, "uniform", "megakernel", 16, 960, 4.4),
            ablation_entry("dsv3", 2048, "uniform", "unfused", 16, 1920, 6.0),
            # qwen3: no entry at the default point for "unfused" (panel b falls back to the best)
            ablation_entry("qwen3-30b-a3b", 8192, "zipf", "megakernel", 16, 4992, 2.0),
            ablation_entry("qwen3-30b-a3b", 8192, "zipf", "unfused", 32, 2496, 3.0),
            # a case the baseline did not run: no baseline fields expected
            ablation_entry("qwen3-235b", 2048, "uniform", "megakernel", 16, 2560, 1.5),
        ]
    return doc


def synthetic_baseline():
    return {"device": "NVIDIA H200", "gpus": 2, "date": "2026-12-01T00:00:01Z", "commit": "abc1234",
            "what": "torch baseline (synthetic)", "torch": "2.x", "nccl": "2.28.9",
            "cases": [{"model": "dsv3", "T": 2048, "routing": "uniform", "baseline_ms": 8.0,
                       "baseline_tflops": 500.0, "ep": 2},
                      {"model": "qwen3-30b-a3b", "T": 8192, "routing": "zipf", "baseline_ms": 5.0,
                       "baseline_tflops": 400.0, "ep": 2}]}


class ForwardReportTest(TempDirCase):

    def report(self, mok, baseline):
        """Runs forward_report.py; `baseline` is a document, a raw string, or None (no file)."""
        mok_path = self.write("mok.json", mok)
        base_path = (os.path.join(self.tmp, "missing-baseline.json") if baseline is None
                     else self.write("baseline.json", baseline))
        out_path = os.path.join(self.tmp, "forward.json")
        run = subprocess.run([sys.executable, REPORT, mok_path, base_path, out_path],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(out_path) as f:
            return json.load(f), run

    def test_join_and_ablation(self):
        mok = synthetic_mok()
        out, run = self.report(mok, synthetic_baseline())
        self.assertEqual(out["commit"], "abc1234")
        self.assertEqual(out["baseline_torch"], "2.x")
        # cases: joined as before, "variant" carried through
        self.assertEqual(out["cases"][0]["variant"], "megakernel")
        self.assertAlmostEqual(out["cases"][0]["baseline_ms"], 8.0)
        self.assertAlmostEqual(out["cases"][0]["speedup"], 2.0)
        self.assertAlmostEqual(out["cases"][1]["speedup"], 2.5)
        # ablation: same entries, same order, mok's fields unchanged
        self.assertEqual(len(out["ablation"]), len(mok["ablation"]))
        for got, want in zip(out["ablation"], mok["ablation"]):
            self.assertEqual({k: got[k] for k in want}, want)
        # baseline_ms / speedup where the baseline ran the same (model, T, routing) ...
        unfused = out["ablation"][4]
        self.assertAlmostEqual(unfused["baseline_ms"], 8.0)
        self.assertAlmostEqual(unfused["speedup"], 8.0 / 6.0)
        self.assertAlmostEqual(out["ablation"][6]["speedup"], 5.0 / 3.0)
        # ... and nowhere else
        self.assertNotIn("baseline_ms", out["ablation"][7])
        self.assertNotIn("speedup", out["ablation"][7])
        # the ablation table: a header, and "vs best" relative to the group's fastest entry
        self.assertIn("vs best", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | unfused | 16 | 1920 | 8192 | 6.000 | 167 | 1.33x | 1.50x |",
                      run.stdout)

    def test_fp8_cases_join_beside_the_bf16_ones(self):
        mok = synthetic_mok(with_ablation=False)
        fp8 = {"cases": [dict(mok_case("dsv3", 2048, "uniform", 2.5), variant="unfused-fp8", precision="fp8")]}
        mok["cases"][0]["mok_bwd_ms"] = 10.0
        base = synthetic_baseline()
        base["cases"][0]["baseline_bwd_ms"] = 20.0
        base["peak_bf16"] = {"burst_tflops": [800.0], "burst_tflops_max": 800.0}
        base["peak_fp8"] = {"burst_tflops": [1600.0], "burst_tflops_max": 1600.0}
        mok_path, base_path = self.write("mok.json", mok), self.write("baseline.json", base)
        fp8_path, out_path = self.write("fp8.json", fp8), os.path.join(self.tmp, "forward.json")
        run = subprocess.run([sys.executable, REPORT, "--fp8", fp8_path, mok_path, base_path, out_path],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(out_path) as f:
            out = json.load(f)
        self.assertEqual([c["precision"] for c in out["cases"]], ["bf16", "bf16", "fp8"])
        c = out["cases"][2]
        self.assertAlmostEqual(c["speedup"], 8.0 / 2.5)   # against the same baseline
        self.assertAlmostEqual(c["bf16_mok_ms"], 4.0)
        self.assertAlmostEqual(c["x_bf16"], 4.0 / 2.5)
        self.assertIn("| dsv3 | 2048 | uniform | fp8 | 2.500 | 4.000 | 1.60x | 8.000 | 3.20x | 400 | 25.0% |",
                      run.stdout)
        # each precision against its own peak; the FP8 case gets no backward fields and stays out of
        # the backward and bf16-peak tables (one dsv3 row in each: the bf16 case)
        self.assertAlmostEqual(out["cases"][0]["mok_pct_of_peak"], 100.0 * 250.0 / 800.0)
        self.assertAlmostEqual(c["mok_pct_of_peak"], 100.0 * 400.0 / 1600.0)
        self.assertEqual(out["peak_fp8"]["burst_tflops_max"], 1600.0)
        for k in ("baseline_bwd_ms", "bwd_speedup", "baseline_pct_of_peak"):
            self.assertNotIn(k, c)
        self.assertEqual(out["cases"][0]["bwd_speedup"], 2.0)
        self.assertEqual(run.stdout.count("| dsv3 | 2048 | uniform | 10.000 | 20.000 | 2.00x |"), 1)
        self.assertEqual(run.stdout.count("| dsv3 | 2048 | uniform | 250 | 31.2% |"), 1)
        self.assertNotIn("| dsv3 | 2048 | uniform | 400 |", run.stdout)
        # two FP8 passes (fp8 and mxfp8), both joined beside the bf16 cases, each with x bf16
        mx = {"cases": [dict(mok_case("dsv3", 2048, "uniform", 3.2), variant="megakernel", precision="mxfp8")]}
        mx_path = self.write("mx.json", mx)
        run = subprocess.run([sys.executable, REPORT, "--fp8", fp8_path, "--fp8", mx_path, mok_path, base_path,
                              out_path], capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(out_path) as f:
            out = json.load(f)
        self.assertEqual([c["precision"] for c in out["cases"]], ["bf16", "bf16", "fp8", "mxfp8"])
        self.assertAlmostEqual(out["cases"][3]["x_bf16"], 4.0 / 3.2)
        self.assertIn("| dsv3 | 2048 | uniform | mxfp8 | 3.200 | 4.000 | 1.25x |", run.stdout)
        # an unreadable FP8 file: reported, the bf16 report still written
        run = subprocess.run([sys.executable, REPORT, "--fp8", os.path.join(self.tmp, "none.json"), mok_path,
                              base_path, out_path], capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("no FP8 results", run.stderr)

    def test_sustained_columns(self):
        mok = synthetic_mok()
        mok["cases"][0].update({"mok_sustained_ms": 4.4, "mok_sustained_tflops": 227.3,
                                "sustained_iterations": 500})
        out, run = self.report(mok, synthetic_baseline())
        self.assertAlmostEqual(out["cases"][0]["mok_sustained_ms"], 4.4)  # carried through
        self.assertIn("mok sustained ms", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | 4.000 | 8.000 | 2.00x | 250 | 500 | 4.400 | 227 | - | - |",
                      run.stdout)
        # a case without the fields shows dashes
        self.assertIn("| - | - | - | - |", run.stdout)
        # with the baseline's sustained time: the sustained speedup
        base = synthetic_baseline()
        base["cases"][0]["baseline_sustained_ms"] = 9.9
        out, run = self.report(mok, base)
        self.assertAlmostEqual(out["cases"][0]["sustained_speedup"], 2.25)
        self.assertNotIn("sustained_speedup", out["cases"][1])
        self.assertIn("| 4.400 | 227 | 9.900 | 2.25x |", run.stdout)

    def test_backward_columns(self):
        mok = synthetic_mok()
        mok["cases"][0].update({"mok_bwd_ms": 6.0, "mok_bwd_tflops": 333.3, "bwd_check_rel_err": 0.002})
        base = synthetic_baseline()
        base["cases"][0].update({"baseline_bwd_ms": 15.0, "baseline_bwd_tflops": 133.3})
        base["cases"][1].update({"baseline_bwd_ms": 9.0, "baseline_bwd_tflops": 222.2})
        base["peak_bf16"] = {"burst_tflops": [666.6, 650.0], "burst_tflops_max": 666.6}
        out, run = self.report(mok, base)
        self.assertAlmostEqual(out["cases"][0]["bwd_speedup"], 2.5)
        self.assertAlmostEqual(out["cases"][0]["mok_bwd_pct_of_peak"], 50.0, places=2)
        self.assertAlmostEqual(out["cases"][1]["baseline_bwd_ms"], 9.0)
        self.assertNotIn("bwd_speedup", out["cases"][1])  # mok did not time this one's backward
        self.assertIn("Backward", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | 6.000 | 15.000 | 2.50x | 333 | 50.0% | 133 | 2.0e-03 |", run.stdout)
        self.assertIn("| qwen3-30b-a3b | 8192 | zipf | - | 9.000 | - | - | - | 222 | - |", run.stdout)
        self.assertNotIn("main_grad", run.stdout)  # no accumulate variant timed: no column
        # with the fp32 main_grad variant timed: its column
        mok["cases"][0]["mok_bwd_accumulate_ms"] = 7.5
        out, run = self.report(mok, base)
        self.assertIn("| dsv3 | 2048 | uniform | 6.000 | 15.000 | 2.50x | 333 | 50.0% | 133 | 2.0e-03 | 7.500 |",
                      run.stdout)
        self.assertIn("| qwen3-30b-a3b | 8192 | zipf | - | 9.000 | - | - | - | 222 | - | - |", run.stdout)
        # neither side timed a backward: no table
        out, run = self.report(synthetic_mok(), synthetic_baseline())
        self.assertNotIn("Backward", run.stdout)

    def test_memory_modes(self):
        mok = synthetic_mok()
        mok["cases"][0].update({"mok_bwd_ms": 6.0, "mok_bwd_tflops": 333.3, "bwd_check_rel_err": 0.002,
                                "macrobatch_tokens": 65536, "memory": {"total_bytes": 6.6e9, "workspace_bytes": 0}})
        for variant, ms, saved in (("megakernel-training-saved", 6.3, 0.8e9), ("megakernel-training-recompute", 8.1, 0.005e9)):
            e = ablation_entry("dsv3", 2048, "uniform", variant, 16, 1920, 4.0)
            e.update({"bwd_ms": ms, "memory": {"total_bytes": saved + 2.0e9, "workspace_bytes": 2.0e9}})
            mok["ablation"].append(e)
        out, run = self.report(mok, synthetic_baseline())
        self.assertEqual([a["bwd_ms"] for a in out["ablation"] if "bwd_ms" in a], [6.3, 8.1])  # kept as written
        self.assertIn("Backward by memory mode", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | resident | 65536 | 6.000 | 1.00x | 6.60 | - |", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | saved | 8192 | 6.300 | 1.05x | 0.80 | 2.00 |", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | recompute | 8192 | 8.100 | 1.35x | 0.01 | 2.00 |", run.stdout)
        out, run = self.report(synthetic_mok(), synthetic_baseline())  # no mode timed: no table
        self.assertNotIn("Backward by memory mode", run.stdout)

    def test_against_the_hardware(self):
        # no peak and no ceiling: no table, no percentage fields
        out, run = self.report(synthetic_mok(), synthetic_baseline())
        self.assertNotIn("Against the hardware", run.stdout)
        self.assertNotIn("mok_pct_of_peak", out["cases"][0])
        # the baseline's peak (largest GPU's figures are the reference) and mok's NVLink fields
        mok = synthetic_mok()
        mok["nvlink_copy_ceiling_GBps"] = 400.0
        mok["nvlink_copy_rates"] = [{"src": 1, "dst": 0, "GBps": 400.0}, {"src": 0, "dst": 1, "GBps": 390.0}]
        mok["cases"][0].update({"mok_sustained_tflops": 200.0, "mok_nvlink_GBps": 100.0,
                                "nvlink_fraction_of_ceiling": 0.25})
        base = synthetic_baseline()
        base["peak_bf16"] = {"burst_tflops": [800.0, 780.0], "burst_tflops_max": 800.0,
                             "sustained_tflops": [660.0, 670.0], "sustained_tflops_max": 670.0}
        out, run = self.report(mok, base)
        self.assertEqual(out["peak_bf16"]["burst_tflops_max"], 800.0)
        self.assertEqual(out["nvlink_copy_ceiling_GBps"], 400.0)
        self.assertEqual(len(out["nvlink_copy_rates"]), 2)
        c0, c1 = out["cases"]
        self.assertAlmostEqual(c0["mok_pct_of_peak"], 100 * 250.0 / 800.0)
        self.assertAlmostEqual(c0["baseline_pct_of_peak"], 100 * 500.0 / 800.0)
        self.assertAlmostEqual(c0["mok_sustained_pct_of_sustained_peak"], 100 * 200.0 / 670.0)
        self.assertNotIn("mok_sustained_pct_of_sustained_peak", c1)  # no sustained figure
        self.assertIn("Against the hardware", run.stdout)
        self.assertIn("burst 800, 780 TFLOP/s, sustained 660, 670 TFLOP/s", run.stdout)
        self.assertIn("| dsv3 | 2048 | uniform | 250 | 31.2% | 200 | 29.9% | 62.5% | 100 | 25% |", run.stdout)
        self.assertIn("| qwen3-30b-a3b | 8192 | zipf | 500 | 62.5% | - | - | 50.0% | - | - |", run.stdout)

    def test_no_ablation_gives_empty_list(self):
        out, run = self.report(synthetic_mok(with_ablation=False), synthetic_baseline())
        self.assertEqual(out["ablation"], [])
        self.assertNotIn("vs best", run.stdout)
        self.assertAlmostEqual(out["cases"][0]["speedup"], 2.0)

    def check_without_baseline(self, baseline):
        out, run = self.report(synthetic_mok(), baseline)
        self.assertIn("baseline", run.stderr)
        self.assertNotIn("baseline_torch", out)
        for entry in out["cases"] + out["ablation"]:
            self.assertNotIn("baseline_ms", entry)
            self.assertNotIn("speedup", entry)
        self.assertEqual(len(out["ablation"]), 8)
        self.assertAlmostEqual(out["cases"][0]["mok_ms"], 4.0)

    def test_gpu_samples(self):
        # GPU 0: 3 busy samples (2 power-capped), 1 idle, 1 at full utilization but low power (a
        # kernel spinning on a flag: not counted); GPU 1: one busy sample with a HW slowdown; a
        # header line and an [N/A] line are skipped.
        csv = ("index, utilization.gpu [%], clocks.sm [MHz], power.draw [W], power.limit [W], reasons\n"
               "0, 100, 1260, 698.5, 700.00, 0x0000000000000004\n"
               "0, 99, 1300, 690.0, 700.00, 0x0000000000000004\n"
               "0, 95, 1500, 600.0, 700.00, 0x0000000000000000\n"
               "0, 0, 1980, 110.0, 700.00, 0x0000000000000001\n"
               "0, 100, 1980, 283.0, 700.00, 0x0000000000000000\n"
               "1, 100, 1400, 650.0, 700.00, 0x0000000000000008\n"
               "1, [N/A], 1400, 650.0, 700.00, 0x0\n")
        samples = self.write("samples.csv", csv)
        mok_path = self.write("mok.json", synthetic_mok())
        base_path = self.write("baseline.json", synthetic_baseline())
        out_path = os.path.join(self.tmp, "forward.json")
        run = subprocess.run([sys.executable, REPORT, mok_path, base_path, out_path, samples],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(out_path) as f:
            out = json.load(f)
        g0, g1 = out["gpu_samples"]
        self.assertEqual(g0["busy_samples"], 3)
        self.assertAlmostEqual(g0["sm_clock_mhz_median"], 1300)
        self.assertAlmostEqual(g0["power_w_median"], 690.0)
        self.assertAlmostEqual(g0["power_limit_w"], 700.0)
        self.assertAlmostEqual(g0["power_capped_share"], 2 / 3)
        self.assertAlmostEqual(g0["hw_slowdown_share"], 0.0)
        self.assertEqual(g1["busy_samples"], 1)
        self.assertAlmostEqual(g1["hw_slowdown_share"], 1.0)
        self.assertIn("| 0 | 3 | 1300 | 690 | 700 | 67% | 0% |", run.stdout)
        # a missing samples file only drops the field
        run = subprocess.run([sys.executable, REPORT, mok_path, base_path, out_path,
                              os.path.join(self.tmp, "none.csv")], capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(out_path) as f:
            self.assertNotIn("gpu_samples", json.load(f))

    def test_missing_baseline(self):
        self.check_without_baseline(None)

    def test_empty_baseline(self):
        self.check_without_baseline("")

    def plot(self, doc):
        forward = self.write("forward-in.json", doc)
        png = os.path.join(self.tmp, "forward.png")
        run = subprocess.run([sys.executable, PLOT, forward, png], capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        with open(png, "rb") as f:
            data = f.read()
        self.assertTrue(data.startswith(PNG_SIGNATURE))
        self.assertGreater(len(data), 1000)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plot_with_ablation(self):
        out, _ = self.report(synthetic_mok(), synthetic_baseline())
        self.plot(out)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plot_with_sustained_rate(self):
        mok = synthetic_mok()
        mok["cases"][0].update({"mok_sustained_ms": 4.4, "mok_sustained_tflops": 227.3})
        out, _ = self.report(mok, synthetic_baseline())
        self.plot(out)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plot_with_backward(self):
        mok = synthetic_mok()
        mok["cases"][0].update({"mok_bwd_ms": 6.0, "mok_bwd_tflops": 333.3})
        base = synthetic_baseline()
        base["cases"][0]["baseline_bwd_ms"] = 15.0
        out, _ = self.report(mok, base)
        self.plot(out)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plot_old_file_and_no_baseline(self):
        out, _ = self.report(synthetic_mok(with_ablation=False), synthetic_baseline())
        del out["ablation"]  # files written before the ablation existed
        self.plot(out)
        out, _ = self.report(synthetic_mok(), None)
        self.plot(out)

    def test_plot_without_matplotlib_exits_2(self):
        # Hide matplotlib from the import system whether or not it is installed.
        hide = ("import runpy, sys; sys.modules['matplotlib'] = None; "
                f"sys.argv = [{PLOT!r}, 'in.json', 'out.png']; runpy.run_path({PLOT!r}, run_name='__main__')")
        run = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, cwd=self.tmp)
        self.assertEqual(run.returncode, 2, run.stderr)
        self.assertIn("pip install matplotlib", run.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
