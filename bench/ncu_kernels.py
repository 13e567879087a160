#!/usr/bin/env python3
"""Per-kernel table of an Nsight Compute run (CSV of `ncu --csv --page raw --print-units base`).

The layer's backward is a chain of short kernels; ncu times each one alone (serialized, so at the
clock an idle GPU gives it, not the one the power cap gives a sustained run), with the DRAM bytes
it moved. This groups one stretch of the launches (from the i-th launch whose name contains
--start to the next such launch, or all of them) by kernel (GEMM kernels by their form) and prints
count, time, share, and DRAM bytes written / read with their rates.

  ncu --clock-control none --csv --page raw --print-units base --launch-count 700 \\
      --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_write.sum,dram__bytes_read.sum \\
      devrun/bin/mok_bench ... > ncu.csv
  python3 bench/ncu_kernels.py ncu.csv [--start backward_routing_kernel] [--nth 0] [--json out.json]
"""
import argparse
import csv
import io
import json
import re
import sys


def kernel_label(name):
    form = re.search(r"\b(Form\w+)", name)
    if "grouped_gemm_kernel" in name and form:
        return "gemm." + form.group(1)
    base = re.sub(r"\(.*", "", name).replace("void ", "")
    while "<" in base:
        stripped = re.sub(r"<[^<>]*>", "", base)
        if stripped == base:
            break
        base = stripped
    return base.split("::")[-1]


def read_launches(path):
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        sys.exit(f"ncu_kernels: {path} has no ncu CSV table (a header line starting with \"ID\")")
    rows = list(csv.reader(io.StringIO("\n".join(lines[head:]))))
    header, data = rows[0], rows[2:]  # (rows[1] holds the units)
    col = {h: i for i, h in enumerate(header)}
    for need in ("Kernel Name", "gpu__time_duration.sum"):
        if need not in col:
            sys.exit(f"ncu_kernels: {path} lacks the column {need}")

    def num(row, key):
        if key not in col or not row[col[key]]:
            return 0.0
        return float(row[col[key]].replace(",", ""))

    return [{"name": r[col["Kernel Name"]], "ns": num(r, "gpu__time_duration.sum"),
             "wr": num(r, "dram__bytes_write.sum"), "rd": num(r, "dram__bytes_read.sum"),
             "hz": num(r, "sm__cycles_elapsed.avg.per_second")} for r in data]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--start", help="substring of the kernel name that starts the stretch")
    ap.add_argument("--nth", type=int, default=0, help="which occurrence of --start (0 = the first)")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    launches = read_launches(a.csv)
    lo, hi = 0, len(launches)
    if a.start:
        starts = [i for i, k in enumerate(launches) if a.start in k["name"]]
        if len(starts) <= a.nth:
            sys.exit(f"ncu_kernels: only {len(starts)} launches named *{a.start}*, asked for index {a.nth}")
        lo = starts[a.nth]
        hi = starts[a.nth + 1] if len(starts) > a.nth + 1 else len(launches)
    groups = {}
    for k in launches[lo:hi]:
        g = groups.setdefault(kernel_label(k["name"]), {"launches": 0, "ms": 0.0, "gb_written": 0.0, "gb_read": 0.0,
                                                         "cycles_ghz": 0.0})
        g["launches"] += 1
        g["ms"] += k["ns"] / 1e6
        g["gb_written"] += k["wr"] / 1e9
        g["gb_read"] += k["rd"] / 1e9
        g["cycles_ghz"] += k["hz"] / 1e9 * k["ns"] / 1e6  # time-weighted, divided below
    total = sum(g["ms"] for g in groups.values()) or 1.0
    table = []
    print(f"launches {lo}..{hi - 1} of {len(launches)}; {total:.3f} ms of kernel time (each kernel alone)")
    print("| kernel | launches | ms | share | GB written | GB read | write TB/s | read TB/s | SM GHz |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, g in sorted(groups.items(), key=lambda kv: -kv[1]["ms"]):
        g["cycles_ghz"] = g["cycles_ghz"] / g["ms"] if g["ms"] else 0.0
        wr_tbps = g["gb_written"] / g["ms"] if g["ms"] else 0.0
        rd_tbps = g["gb_read"] / g["ms"] if g["ms"] else 0.0
        table.append({"kernel": label, **{k: round(v, 4) for k, v in g.items()},
                      "write_tbps": round(wr_tbps, 3), "read_tbps": round(rd_tbps, 3)})
        print(f"| {label} | {g['launches']} | {g['ms']:.3f} | {100 * g['ms'] / total:.1f}% | {g['gb_written']:.2f} "
              f"| {g['gb_read']:.2f} | {wr_tbps:.2f} | {rd_tbps:.2f} | {g['cycles_ghz']:.2f} |")
    if a.json:
        json.dump({"source": a.csv, "first_launch": lo, "last_launch": hi - 1, "total_ms": round(total, 4),
                   "kernels": table}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
