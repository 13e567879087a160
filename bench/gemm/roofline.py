#!/usr/bin/env python3
"""Roofline of the grouped-GEMM benchmark's forward and dgrad cases: min(measured dense bf16
peak, FLOPs / (minimum bytes / memory bandwidth)).

Minimum bytes = every weight of the grouped experts once + the activations once + the output
once (bf16): E*N*K*2 + rows*K*2 + rows*N*2 (dgrad_swiglu, N = inter: its output is d_gu, 2N
wide, and it also reads gu, 2N wide: rows*N*2 becomes rows*4N*2). At 128 rows per expert a weight element serves only
128 rows (256 FLOP per 2 bytes), so these cases sit near or below the memory ridge of an H200
(~800 TF/s / ~4.3 TB/s = ~186 FLOP/B) and the memory term decides.

Two memory figures: the device-to-device copy rate (read + write) measured in the same run, an
estimate of what a streaming kernel reaches (a read-heavy stream such as a GEMM's weights can do
somewhat better), and the HBM3e datasheet peak of 4.8 TB/s, a hard bound.

  python3 bench/gemm/roofline.py bench/results/gemm-h200x1.json [--copy-tbps 4.3]

Without --copy-tbps the file's `copy_tbps` (measured by torch_baseline.py in the same run) is
used, or else 4.3 TB/s (the device-to-device copy the tool library's KINDS.md reports for these
machines). make_json.py adds `roofline_tflops` (copy-based) to every case through
roofline_tflops().
"""
import argparse
import json
import sys

DEFAULT_COPY_TBPS = 4.3
FORMS_WITH_BYTES = ("fc1", "fc2", "dgrad", "dgrad_swiglu")
HBM_PEAK_TBPS = 4.8  # H200 datasheet


def min_bytes(case, rows):
    if case["form"] not in FORMS_WITH_BYTES:
        return None
    e, n, k = case["experts"], case["n"], case["k"]
    if case["form"] == "dgrad_swiglu":  # also reads gu and writes d_gu: 2n columns each, no d_h
        return 2.0 * (e * n * k + rows * k + 4 * rows * n)
    return 2.0 * (e * n * k + rows * k + rows * n)


def roofline_tflops(case, flops, peak_tflops, mem_tbps):
    """None for forms without a byte model (wgrad) or missing or zero inputs."""
    if case.get("form") not in FORMS_WITH_BYTES:
        return None
    if not flops or not peak_tflops or not mem_tbps or not case.get("n") or not case.get("k"):
        return None
    rows = flops / (2.0 * case["n"] * case["k"])
    b = min_bytes(case, rows)
    mem_tflops = flops / (b / (mem_tbps * 1e12)) / 1e12
    return min(peak_tflops, mem_tflops)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--copy-tbps", type=float)
    a = ap.parse_args()
    d = json.load(open(a.json))
    copy = a.copy_tbps or d.get("copy_tbps") or DEFAULT_COPY_TBPS
    peak = d.get("peak_bf16_tflops")
    if not peak:
        print(f"{a.json}: no peak_bf16_tflops (torch baseline missing?): no roofline", file=sys.stderr)
        return 1
    print(f"{d['device']}, commit {d.get('commit', '?')[:10]}: peak {peak} TF/s, copy {copy} TB/s "
          f"(roof), HBM datasheet {HBM_PEAK_TBPS} TB/s (hard bound)")
    print(f"{'case':<24}{'rows':>5} {'routing':<8}{'mok':>7}{'torch':>7}{'roof':>7}{'hard':>7}{'mok%':>6}"
          f"{'bar':>7}  bar vs roof / hard bound")
    for c in d["cases"]:
        flops = c.get("flops") or (c["mok_tflops"] * c["mok_ms"] * 1e9 if c.get("mok_ms") else None)
        r = roofline_tflops(c, flops, peak, copy)
        if r is None:
            continue
        hard = roofline_tflops(c, flops, peak, HBM_PEAK_TBPS)
        t = c.get("torch_grouped_mm_tflops")
        bar = (1.25 if c["rows_per_expert"] == 128 else 1.05) * t if t else None
        verdict = ""
        if bar is not None:
            verdict = f"{100 * bar / r:.0f}% / {100 * bar / hard:.0f}%"
            if bar > hard:
                verdict += "  ABOVE the hard bound"
            elif bar > r:
                verdict += "  above the copy-rate roof"
        print(f"{c['name']:<24}{c['rows_per_expert']:>5} {c['routing']:<8}{c['mok_tflops']:>7.0f}"
              f"{(t or float('nan')):>7.0f}{r:>7.0f}{hard:>7.0f}{100 * c['mok_tflops'] / r:>5.0f}%"
              f"{(bar or float('nan')):>7.0f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
