#!/usr/bin/env python3
"""Joins the results files of an A/B run of mok_bench (the variants run alternately in one device
call, e.g. unfused, fused, unfused, fused) into one results file: per case the figure `--field`
of every run of every variant, their median, and each variant's median over the first variant's.

  ab_report.py --out bench/results/backward-program-h200x1.json --commit 71f3d60 \\
      --field mok_bwd_ms --variant unfused='ab_unfused_*.json' --variant fused='ab_fused_*.json' \\
      [--what 'text']

Prints the table (markdown) as well. The device, GPU count and date come from the first file.
With --base-commit (the first variant is the base build, the second this one; more variants may
follow, e.g. an experiment's build, each with its ratio to the first as always) every case also
gets base_ms and new_ms (the first two medians), new_over_base, and where the runs recorded the
forward's output hash (mok_bench's out_hash) whether every run of the variants gave the same bits
(runtime-ab-<gpu>.json)."""
import argparse
import glob
import json
import statistics
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True, help="the commit the runs measured")
    ap.add_argument("--field", default="mok_bwd_ms", help="the case figure compared (default mok_bwd_ms)")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=GLOB",
                    help="a variant and its results files (repeat; the first is the reference)")
    ap.add_argument("--what", default="", help="what the variants are (recorded in the file)")
    ap.add_argument("--base-commit", help="the first variant is a build of this commit (base_ms / new_ms per case)")
    a = ap.parse_args(argv)
    variants = []
    if a.base_commit and len(a.variant) < 2:
        ap.error("--base-commit takes at least two variants: the base build, then the new one")
    for v in a.variant:
        name, sep, pattern = v.partition("=")
        files = sorted(glob.glob(pattern))
        if not sep or not name or not files:
            ap.error(f"--variant {v!r}: expected NAME=GLOB matching at least one file")
        variants.append((name, [json.load(open(f)) for f in files]))
    meta = variants[0][1][0]
    cases, hashes = {}, {}
    for name, runs in variants:
        for run in runs:
            for c in run["cases"]:
                if a.field not in c:
                    sys.exit(f"ab_report: case {c['model']} T={c['T']} of variant {name} has no '{a.field}'")
                key = (c["model"], c["T"], c["routing"])  # a slice's model is e.g. "dsv3/ep8"
                cases.setdefault(key, {}).setdefault(name, []).append(c[a.field])
                if "out_hash" in c:
                    hashes.setdefault(key, {}).setdefault(name, set()).add(tuple(c["out_hash"]))
    out_cases = []
    ref = variants[0][0]
    print(f"| model | T | routing | " + " | ".join(f"{n} {a.field}" for n, _ in variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    for (model, T, routing), by in cases.items():
        entry = {"model": model, "T": T, "routing": routing}
        cells = []
        for name, _ in variants:
            runs = by.get(name, [])
            med = statistics.median(runs) if runs else None
            entry[name] = {"runs": runs, "median": med}
            if med is not None and by.get(ref) and name != ref:
                entry[name]["over_" + ref] = med / statistics.median(by[ref])
                cells.append(f"{med:.3f} ({entry[name]['over_' + ref]:.3f}x)")
            else:
                cells.append(f"{med:.3f}" if med is not None else "-")
        if a.base_commit:
            base, new = entry[variants[0][0]]["median"], entry[variants[1][0]]["median"]
            entry.update({"base_ms": base, "new_ms": new,
                          "new_over_base": new / base if base and new is not None else None})
            h = hashes.get((model, T, routing), {})
            if h:
                seen = set().union(*h.values())
                entry["out_hashes"] = sorted(list(x) for x in seen)
                entry["bitwise_same"] = len(seen) == 1 and len(h) == len(variants)
        out_cases.append(entry)
        print(f"| {model} | {T} | {routing} | " + " | ".join(cells) + " |")
    doc = {"device": meta.get("device"), "gpus": meta.get("gpus"), "date": meta.get("date"), "commit": a.commit,
           **({"base_commit": a.base_commit} if a.base_commit else {}),
           "field": a.field, "what": a.what,
           "method": "mok_bench runs of the variants alternated in one device call; per run the slowest rank's "
                     "median of its iterations; here every run and their median per variant",
           "variants": [n for n, _ in variants], "cases": out_cases}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
