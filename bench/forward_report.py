#!/usr/bin/env python3
"""Joins mok_bench's GPU forward results with the PyTorch+NCCL baseline of the same run into one
results file (bench/results/forward-<gpu>x<n>.json) and prints the comparison table.

usage: forward_report.py MOK_JSON BASELINE_JSON OUT_JSON
"""
import json
import sys


def main():
    mok_path, base_path, out_path = sys.argv[1:4]
    mok = json.load(open(mok_path))
    base = json.load(open(base_path))
    by_key = {(c["model"], c["T"], c["routing"]): c for c in base["cases"]}
    cases = []
    for c in mok["cases"]:
        b = by_key.get((c["model"], c["T"], c["routing"]))
        row = dict(c)
        if b:
            row["baseline_ms"] = b["baseline_ms"]
            row["baseline_tflops"] = b["baseline_tflops"]
            row["speedup"] = b["baseline_ms"] / c["mok_ms"]
        cases.append(row)
    out = {k: mok[k] for k in ("device", "gpus", "date", "commit", "ep")}
    out["what"] = mok["what"] + "; baseline: " + base["what"]
    out["baseline_torch"] = base.get("torch")
    out["baseline_nccl"] = base.get("nccl")
    out["cases"] = cases
    json.dump(out, open(out_path, "w"), indent=1)
    print(f"\nForward, {out['gpus']} x {out['device']}, EP {out['ep']} (commit {out['commit']})")
    print("| model | T/rank | routing | mok ms | baseline ms | speedup | mok TFLOP/s/GPU | baseline TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cases:
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {c['mok_ms']:.3f} | {c.get('baseline_ms', float('nan')):.3f} "
              f"| {c.get('speedup', float('nan')):.2f}x | {c['mok_tflops']:.0f} | {c.get('baseline_tflops', float('nan')):.0f} |")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
