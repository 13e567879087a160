#!/usr/bin/env python3
"""Roofline of the grouped-GEMM benchmark's forward and dgrad cases: the rate a kernel cannot
beat, min(measured dense bf16 peak, FLOPs / (minimum bytes / measured copy bandwidth)).

Minimum bytes = every weight of the grouped experts once + the activations once + the output
once (bf16): E*N*K*2 + rows*K*2 + rows*N*2. At 128 rows per expert a weight element serves only
128 rows (256 FLOP per 2 bytes), so these cases sit near or below the memory ridge of an H200
(~800 TF/s / ~4.3 TB/s = ~186 FLOP/B) and the memory term decides.

  python3 bench/gemm/roofline.py bench/results/gemm-h200x1.json [--copy-tbps 4.3]

Without --copy-tbps the file's `copy_tbps` (measured by torch_baseline.py in the same run) is
used, or else 4.3 TB/s (the device-to-device copy the tool library's KINDS.md reports for these
machines). make_json.py adds `roofline_tflops` to every case through roofline_tflops().
"""
import argparse
import json

DEFAULT_COPY_TBPS = 4.3


def min_bytes(case, rows):
    if case["form"] not in ("fc1", "fc2", "dgrad"):
        return None
    e, n, k = case["experts"], case["n"], case["k"]
    return 2.0 * (e * n * k + rows * k + rows * n)


def roofline_tflops(case, flops, peak_tflops, copy_tbps):
    """None for forms without a byte model (wgrad) or missing inputs."""
    if not flops or not peak_tflops or not copy_tbps:
        return None
    rows = flops / (2.0 * case["n"] * case["k"])
    b = min_bytes(case, rows)
    if b is None:
        return None
    mem_tflops = flops / (b / (copy_tbps * 1e12)) / 1e12
    return min(peak_tflops, mem_tflops)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--copy-tbps", type=float)
    a = ap.parse_args()
    d = json.load(open(a.json))
    copy = a.copy_tbps or d.get("copy_tbps") or DEFAULT_COPY_TBPS
    peak = d["peak_bf16_tflops"]
    print(f"{d['device']}, commit {d.get('commit', '?')[:10]}: peak {peak} TF/s, copy {copy} TB/s")
    print(f"{'case':<24}{'rows':>5} {'routing':<8}{'mok':>7}{'torch':>7}{'roof':>7}{'mok%':>6}"
          f"{'bar':>7}  bar vs roofline")
    for c in d["cases"]:
        flops = c.get("flops") or (c["mok_tflops"] * c["mok_ms"] * 1e9 if c.get("mok_ms") else None)
        r = roofline_tflops(c, flops, peak, copy)
        if r is None:
            continue
        t = c.get("torch_grouped_mm_tflops")
        bar = (1.25 if c["rows_per_expert"] == 128 else 1.05) * t if t else None
        verdict = "" if bar is None else ("ABOVE the roofline" if bar > r else f"{100 * bar / r:.0f}% of it")
        print(f"{c['name']:<24}{c['rows_per_expert']:>5} {c['routing']:<8}{c['mok_tflops']:>7.0f}"
              f"{(t or float('nan')):>7.0f}{r:>7.0f}{100 * c['mok_tflops'] / r:>5.0f}%"
              f"{(bar or float('nan')):>7.0f}  {verdict}")


if __name__ == "__main__":
    main()
