#!/usr/bin/env python3
"""Joins mok_bench's GPU forward results with the PyTorch+NCCL baseline of the same run into one
results file (bench/results/forward-<gpu>x<n>.json) and prints the comparison tables.

usage: forward_report.py MOK_JSON BASELINE_JSON OUT_JSON

MOK_JSON holds `cases` (one per model, T, routing, at mok's default settings) and optionally
`ablation` (the same cases under other variants / comm SMs / minibatch / macrobatch sizes). Both
are copied to OUT_JSON; every case and ablation entry whose (model, T, routing) the baseline also
ran gets `baseline_ms` and `speedup` (= baseline_ms / mok's ms). If BASELINE_JSON is missing,
empty or unreadable, OUT_JSON still gets written with mok's numbers only (no baseline fields).
"""
import json
import math
import os
import sys


def case_key(entry):
    return (entry["model"], entry["T"], entry["routing"])


def load_baseline(path):
    """The baseline JSON, or None (with the reason on stderr) when it cannot be used."""
    if not os.path.isfile(path):
        why = "does not exist"
    elif os.path.getsize(path) == 0:
        why = "is empty"
    else:
        try:
            with open(path) as f:
                base = json.load(f)
            if isinstance(base, dict) and isinstance(base.get("cases"), list):
                return base
            why = "has no list 'cases'"
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            why = f"cannot be read ({e})"
    print(f"forward_report: baseline {path} {why}; writing mok's numbers only", file=sys.stderr)
    return None


def speedup(baseline_ms, ms):
    return baseline_ms / ms if ms and ms > 0 else None


def join(mok, base):
    """The output document: mok's cases and ablation, each joined with the baseline when known."""
    by_key = {case_key(c): c for c in base["cases"]} if base else {}
    cases = []
    for c in mok["cases"]:
        row = dict(c)
        b = by_key.get(case_key(c))
        if b:
            row["baseline_ms"] = b["baseline_ms"]
            row["baseline_tflops"] = b["baseline_tflops"]
            s = speedup(b["baseline_ms"], c["mok_ms"])
            if s is not None:
                row["speedup"] = s
        cases.append(row)
    ablation = []
    for a in mok.get("ablation") or []:
        row = dict(a)  # every field mok_bench wrote stays as it is
        b = by_key.get(case_key(a))
        if b:
            row["baseline_ms"] = b["baseline_ms"]
            s = speedup(b["baseline_ms"], a["ms"])
            if s is not None:
                row["speedup"] = s
        ablation.append(row)

    out = {k: mok.get(k) for k in ("device", "gpus", "date", "commit", "ep")}
    if base:
        out["what"] = mok.get("what", "") + "; baseline: " + base.get("what", "")
        out["baseline_torch"] = base.get("torch")
        out["baseline_nccl"] = base.get("nccl")
    else:
        out["what"] = mok.get("what", "") + "; baseline: not available"
    out["cases"] = cases
    out["ablation"] = ablation
    return out


def fmt(value, spec, suffix=""):
    """`value` formatted with `spec`, or a dash when it is absent or not a number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def print_cases(out):
    print(f"\nForward, {out['gpus']} x {out['device']}, EP {out['ep']} (commit {out['commit']})")
    print("| model | T/rank | routing | mok ms | baseline ms | speedup | mok TFLOP/s/GPU | baseline TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for c in out["cases"]:
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {fmt(c['mok_ms'], '.3f')} "
              f"| {fmt(c.get('baseline_ms'), '.3f')} | {fmt(c.get('speedup'), '.2f', 'x')} "
              f"| {fmt(c.get('mok_tflops'), '.0f')} | {fmt(c.get('baseline_tflops'), '.0f')} |")


def ablation_groups(ablation):
    """{(model, T, routing): [entries]} in the order the keys first appear."""
    groups = {}
    for a in ablation:
        groups.setdefault(case_key(a), []).append(a)
    return groups


def print_ablation(out):
    if not out["ablation"]:
        return
    print(f"\nForward ablation (speedup: vs the baseline; vs best: ms / fastest ms of the same "
          f"model, T, routing)")
    print("| model | T/rank | routing | variant | comm SMs | minibatch | macrobatch | ms | TFLOP/s/GPU "
          "| speedup | vs best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, t, routing), entries in ablation_groups(out["ablation"]).items():
        timed = [a["ms"] for a in entries if a.get("ms") and a["ms"] > 0]
        best = min(timed) if timed else None
        for a in entries:
            vs_best = a["ms"] / best if best and a.get("ms") else None
            print(f"| {model} | {t} | {routing} | {a.get('variant', '-')} | {fmt(a.get('comm_sms'), '')} "
                  f"| {fmt(a.get('minibatch_tokens'), '')} | {fmt(a.get('macrobatch_tokens'), '')} "
                  f"| {fmt(a.get('ms'), '.3f')} | {fmt(a.get('tflops'), '.0f')} "
                  f"| {fmt(a.get('speedup'), '.2f', 'x')} | {fmt(vs_best, '.2f', 'x')} |")


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mok_path, base_path, out_path = argv
    with open(mok_path) as f:
        mok = json.load(f)
    out = join(mok, load_baseline(base_path))
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print_cases(out)
    print_ablation(out)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
