#!/usr/bin/env python3
"""Self-test of bench/ncu_kernels.py on a synthetic ncu CSV (--csv --page raw --print-units base)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ncu_kernels import kernel_label  # noqa: E402

WGRAD = ("grouped_gemm_kernel<gemm::Cfg<256, gemm::OperandBf16, 0>, gemm::FormWgrad, 0>"
         "(CUtensorMap_st, CUtensorMap_st, gemm::KernelParams)")
MERGE = "void gpu::<unnamed>::merge_kernel<1>(const uint4 *, const uint4 *, const float *, int)"


def csv_text(launches):
    cols = ["ID", "Kernel Name", "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
            "sm__cycles_elapsed.avg.per_second"]
    lines = ["==PROF== Connected to process 1", "[a program's own output line]",
             ",".join(f'"{c}"' for c in cols),
             ",".join(f'"{u}"' for u in ["", "", "byte", "byte", "ns", "Hz"])]
    for i, (name, ns, wr, rd) in enumerate(launches):
        lines.append(",".join(f'"{v}"' for v in [i, name, f"{rd:,}", f"{wr:,}", f"{ns:,}", "1,700,000,000"]))
    return "\n".join(lines) + "\n"


class NcuKernels(unittest.TestCase):
    def test_labels(self):
        self.assertEqual(kernel_label(WGRAD), "gemm.FormWgrad")
        self.assertEqual(kernel_label(MERGE), "merge_kernel")
        self.assertEqual(kernel_label("barrier_kernel(mok::DevComm, int)"), "barrier_kernel")

    def test_stretch_between_two_start_kernels(self):
        launches = [("barrier_kernel(int)", 3000, 0, 0),
                    ("backward_routing_kernel(int)", 4000, 0, 0),
                    (WGRAD, 1000000, 1500000000, 200000000),
                    (WGRAD, 500000, 700000000, 100000000),
                    (MERGE, 300000, 100000000, 900000000),
                    ("backward_routing_kernel(int)", 4000, 0, 0),
                    (WGRAD, 9000000, 0, 0)]
        with tempfile.TemporaryDirectory() as d:
            path, out = os.path.join(d, "ncu.csv"), os.path.join(d, "k.json")
            with open(path, "w") as f:
                f.write(csv_text(launches))
            r = subprocess.run([sys.executable, os.path.join(HERE, "ncu_kernels.py"), path, "--start",
                                "backward_routing_kernel", "--json", out], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            table = {k["kernel"]: k for k in json.load(open(out))["kernels"]}
        self.assertEqual(set(table), {"backward_routing_kernel", "gemm.FormWgrad", "merge_kernel"})
        w = table["gemm.FormWgrad"]
        self.assertEqual(w["launches"], 2)  # the third one is past the next start
        self.assertAlmostEqual(w["ms"], 1.5)
        self.assertAlmostEqual(w["gb_written"], 2.2)
        self.assertAlmostEqual(w["write_tbps"], 2.2 / 1.5, places=3)
        self.assertAlmostEqual(table["merge_kernel"]["read_tbps"], 3.0, places=3)

    def test_missing_table_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "empty.csv")
            with open(path, "w") as f:
                f.write("==PROF== No kernels were profiled.\n")
            r = subprocess.run([sys.executable, os.path.join(HERE, "ncu_kernels.py"), path],
                               capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("no ncu CSV table", r.stderr)


if __name__ == "__main__":
    unittest.main()
