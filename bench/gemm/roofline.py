#!/usr/bin/env python3
"""Roofline of the grouped-GEMM benchmark's forward and dgrad cases: min(measured dense peak of
the case's precision (bf16, or FP8 for the *_fp8 forms), FLOPs / (minimum bytes / memory
bandwidth)).

Minimum bytes = every weight of the grouped experts once + the activations once + the output
once (bf16): E*N*K*2 + rows*K*2 + rows*N*2 (dgrad_swiglu, N = inter: its output is d_gu, 2N
wide, and it also reads gu, 2N wide: rows*N*2 becomes rows*4N*2). At 128 rows per expert a weight element serves only
128 rows (256 FLOP per 2 bytes), so these cases sit near or below the memory ridge of an H200
(~800 TF/s / ~4.3 TB/s = ~186 FLOP/B) and the memory term decides.

Two memory figures: the device-to-device copy rate (read + write) measured in the same run, an
estimate of what a streaming kernel reaches (a read-heavy stream such as a GEMM's weights can do
somewhat better), and the HBM3e datasheet peak of 4.8 TB/s, a hard bound.

A third, tighter bound where the file has `read_tbps` (mok_read_ceiling, same device call: the best
read-only rate of several readers, the GEMM's own TMA weight stream among them): the bytes a case
must read (weights + inputs, no output) at that rate. A bar above it needs a faster read stream
than any reader reached on the device.

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
# E4M3 operands (1 byte); fc1_fp8 stores h in E4M3, fc2_fp8 and dgrad_fp8 (the plain form on a
# dgrad's shape) a bf16 output.
FP8_FORMS = ("fc1_fp8", "fc2_fp8", "dgrad_fp8", "dgrad_swiglu_fp8", "wgrad_fp8")
# (no byte model for the weight gradients, bf16 or FP8: their K is the expert's rows)
FORMS_WITH_BYTES = ("fc1", "fc2", "dgrad", "dgrad_fc1", "dgrad_swiglu", "fc1_fp8", "fc2_fp8", "dgrad_fp8")
HBM_PEAK_TBPS = 4.8  # H200 datasheet


def min_bytes(case, rows):
    if case["form"] not in FORMS_WITH_BYTES:
        return None
    e, n, k = case["experts"], case["n"], case["k"]
    if case["form"] == "fc1_fp8":  # h: n / 2 columns of one byte (its 1x128 scales: 1/32 more)
        return e * n * k + rows * k + rows * n / 2
    if case["form"] in ("fc2_fp8", "dgrad_fp8"):
        return e * n * k + rows * k + 2.0 * rows * n
    if case["form"] == "dgrad_swiglu":  # also reads gu and writes d_gu: 2n columns each, no d_h
        return 2.0 * (e * n * k + rows * k + 4 * rows * n)
    return 2.0 * (e * n * k + rows * k + rows * n)


def read_bytes(case, rows):
    """Bytes a case must read: every weight once and its inputs once (dgrad_swiglu also reads gu,
    2n wide). None for forms without a byte model."""
    if case["form"] not in FORMS_WITH_BYTES:
        return None
    e, n, k = case["experts"], case["n"], case["k"]
    if case["form"] in FP8_FORMS:
        return float(e * n * k + rows * k)
    gu = 2 * rows * n if case["form"] == "dgrad_swiglu" else 0
    return 2.0 * (e * n * k + rows * k + gu)


def read_bound_tflops(case, flops, read_tbps):
    """FLOPs over the time to read read_bytes at read_tbps; None without a model or inputs."""
    if case.get("form") not in FORMS_WITH_BYTES or not flops or not read_tbps or not case.get("n") \
            or not case.get("k"):
        return None
    rows = flops / (2.0 * case["n"] * case["k"])
    return flops / (read_bytes(case, rows) / (read_tbps * 1e12)) / 1e12


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


def case_peak(case, results):
    """The dense peak of the case's precision: cuBLAS FP8 8192^3 (peak_fp8_tflops) for the FP8
    forms where the file has it, else the bf16 peak."""
    if case.get("form") in FP8_FORMS:
        return results.get("peak_fp8_tflops")
    return results.get("peak_bf16_tflops")


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
    read = d.get("read_tbps")
    print(f"{d['device']}, commit {d.get('commit', '?')[:10]}: peak {peak} TF/s, copy {copy} TB/s "
          f"(roof), HBM datasheet {HBM_PEAK_TBPS} TB/s (hard bound)"
          + (f", measured read ceiling {read} TB/s (read bound)" if read else ""))
    print(f"{'case':<24}{'rows':>5} {'routing':<8}{'mok':>7}{'torch':>7}{'roof':>7}{'read':>7}{'hard':>7}"
          f"{'mok%':>6}{'bar':>7}  bar vs roof / read bound / hard bound")
    nan = float("nan")
    for c in d["cases"]:
        flops = c.get("flops") or (c["mok_tflops"] * c["mok_ms"] * 1e9 if c.get("mok_ms") else None)
        cpeak = case_peak(c, d)
        r = roofline_tflops(c, flops, cpeak, copy)
        if r is None:
            continue
        hard = roofline_tflops(c, flops, cpeak, HBM_PEAK_TBPS)
        rb = read_bound_tflops(c, flops, read)
        t = c.get("torch_grouped_mm_tflops")
        bar = (1.25 if c["rows_per_expert"] == 128 else 1.05) * t if t else None
        verdict = ""
        if bar is not None:
            verdict = f"{100 * bar / r:.0f}% / " + (f"{100 * bar / rb:.0f}%" if rb else "-") + \
                f" / {100 * bar / hard:.0f}%"
            if bar > hard:
                verdict += "  ABOVE the hard bound"
            elif rb and bar > rb:
                verdict += "  ABOVE the measured read ceiling"
            elif bar > r:
                verdict += "  above the copy-rate roof"
        print(f"{c['name']:<24}{c['rows_per_expert']:>5} {c['routing']:<8}{c['mok_tflops']:>7.0f}"
              f"{(t or nan):>7.0f}{r:>7.0f}{(rb or nan):>7.0f}{hard:>7.0f}{100 * c['mok_tflops'] / r:>5.0f}%"
              f"{(bar or nan):>7.0f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
