#!/usr/bin/env python3
"""Merges mok_gemm_bench's and torch_baseline.py's JSON (same device call) into
bench/results/gemm-h200x1.json and prints the table. With several passes (mok, torch, mok,
torch, ... alternating in one call), each side's time is the mean over its passes.

  python3 bench/gemm/make_json.py --mok mok1.json [mok2.json] --torch torch1.json [torch2.json] \
      --out gemm-h200x1.json [--fp8-out gemm-fp8-h200x1.json] [--commit SHA] [--date YYYY-MM-DD] \
      [--read read.json]

--read: mok_read_ceiling's JSON from the same call; adds `read_tbps` and each case's
`read_bound_tflops` (the time to read its weights and inputs once at that rate).
Every case gets a `precision` (bf16, or fp8 for the *_fp8 forms, whose roofline uses cuBLAS's FP8
8192^3 rate, `peak_fp8_tflops`, and one-byte operands); an FP8 case also gets `bf16_mok_tflops`
and `x_bf16`, mok's BF16 form of the same case in the same run. --fp8-out writes the FP8 cases
alone (same keys) as well.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEFAULT_COPY_TBPS, FP8_FORMS, read_bound_tflops, roofline_tflops  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mok", required=True, nargs="+")
    ap.add_argument("--torch", required=True, nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit")
    ap.add_argument("--date")
    ap.add_argument("--read", help="mok_read_ceiling JSON (same call)")
    ap.add_argument("--fp8-out", help="also write the FP8 cases alone to this file")
    a = ap.parse_args()
    read = None
    if a.read:
        try:
            read = json.load(open(a.read))
        except Exception as e:  # noqa: BLE001 - reported; the rest of the merge still counts
            print(f"warning: no read ceiling from {a.read}: {e}")
    read_tbps = read.get("read_tbps") if read else None
    moks = [json.load(open(f)) for f in a.mok]
    tors = []
    for f in a.torch:
        try:
            tors.append(json.load(open(f)))
        except Exception:  # noqa: BLE001 - a missing pass is reported, not fatal
            print(f"warning: no torch results in {f}")
    mok, tor = moks[0], tors[0]
    commit = a.commit
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"

    def key(c):
        return (c["name"], c["rows_per_expert"], c["routing"])

    def mean(v):
        v = [x for x in v if x is not None]
        return sum(v) / len(v) if v else None

    mok_passes = [{key(c): c for c in m["cases"]} for m in moks]
    tor_passes = [{key(c): c for c in t["cases"]} for t in tors]
    peak = mean([t["peak_bf16_tflops"] for t in tors if t.get("peak_bf16_tflops")])
    peak8 = mean([t.get("peak_fp8_tflops") for t in tors if t.get("peak_fp8_tflops")])
    copy = mean([t.get("copy_tbps") for t in tors if t.get("copy_tbps")])
    cases = []
    for c in mok["cases"]:
        k = key(c)
        mms = [p[k]["mok_ms"] for p in mok_passes if k in p and p[k]["mok_ms"] == p[k]["mok_ms"]]
        tms = [p[k].get("torch_ms") for p in tor_passes if k in p]
        sms = [p[k].get("torch_fc1_swiglu_ms") for p in tor_passes if k in p]
        dms = [p[k].get("torch_dgrad_swiglu_ms") for p in tor_passes if k in p]
        mm, tm, sm, dm = mean(mms), mean(tms), mean(sms), mean(dms)
        mt = c["flops"] / (mm * 1e-3) / 1e12 if mm else 0.0
        tt = c["flops"] / (tm * 1e-3) / 1e12 if tm else None
        st = c["flops"] / (sm * 1e-3) / 1e12 if sm else None
        terr = next((p[k]["torch_error"] for p in tor_passes if k in p and "torch_error" in p[k]), None)
        fp8 = c["form"] in FP8_FORMS
        cases.append({
            "name": c["name"], "form": c["form"], "precision": "fp8" if fp8 else "bf16",
            "rows_per_expert": c["rows_per_expert"], "routing": c["routing"], "mok_tflops": round(mt, 1),
            "torch_grouped_mm_tflops": None if tt is None else round(tt, 1),
            "speedup": None if not tt else round(mt / tt, 3),
            **({"torch_fc1_swiglu_tflops": round(st, 1)} if st else {}),
            **({"torch_dgrad_swiglu_tflops": round(c["flops"] / (dm * 1e-3) / 1e12, 1)} if dm else {}),
            "mok_tflops_passes": [round(c["flops"] / (x * 1e-3) / 1e12, 1) for x in mms],
            "torch_tflops_passes": [round(c["flops"] / (x * 1e-3) / 1e12, 1) for x in tms if x],
            "mok_ms": mm, "torch_ms": tm,
            "experts": c["experts"], "n": c["n"], "k": c["k"], "m": c["m"],
            "block_n": c.get("block_n"), "skew": c.get("skew"), "group_m": c.get("group_m"),
            "cluster": c.get("cluster"), "split_n": c.get("split_n"),
            "check_rel_err": c["check_rel_err"], "flops": c["flops"],
            "roofline_tflops": (lambda r: None if r is None else round(r, 1))(
                roofline_tflops(c, c["flops"], peak8 if fp8 else peak, copy or DEFAULT_COPY_TBPS)),
            **({"read_bound_tflops": round(rb, 1)} if (rb := read_bound_tflops(c, c["flops"], read_tbps)) else {}),
            **({"torch_error": terr} if terr else {}),
        })
    # Each FP8 case beside mok's BF16 form of the same model, rows and routing (fc1_fp8 <-> fc1).
    by_key = {(c["name"], c["rows_per_expert"], c["routing"]): c for c in cases}
    for c in cases:
        if c["precision"] != "fp8":
            continue
        twin = by_key.get((c["name"].replace("_fp8", ""), c["rows_per_expert"], c["routing"]))
        if twin and twin["mok_tflops"] > 0:
            c["bf16_mok_tflops"] = twin["mok_tflops"]
            c["x_bf16"] = round(c["mok_tflops"] / twin["mok_tflops"], 3)
    res = {
        "device": mok["device"], "gpus": 1,
        "date": a.date or datetime.date.today().isoformat(),
        "commit": commit, "torch": tor.get("torch"),
        "peak_bf16_tflops": round(peak, 1) if peak else None,
        "peak_fp8_tflops": round(peak8, 1) if peak8 else None,
        "copy_tbps": round(copy, 3) if copy else DEFAULT_COPY_TBPS,
        "copy_tbps_source": "measured in this run (torch_baseline.py)" if copy else "default (KINDS.md), not measured",
        "roofline": "roofline_tflops = min(peak_bf16_tflops, flops / minimum bytes * copy_tbps); minimum "
                    "bytes = weights + activations + output once, bf16 (bench/gemm/roofline.py; copy_tbps "
                    f"measured in the same run, else {DEFAULT_COPY_TBPS})",
        **({"read_tbps": round(read_tbps, 3), "read_tbps_source": "mok_read_ceiling in this run, best of: "
            + read.get("best", "?"), "read_bound": "read_bound_tflops = flops / (weights + inputs once, "
            "bf16) * read_tbps: no kernel that reads them once at the best measured read rate is faster",
            "read_readers": read.get("readers", [])}
           if read_tbps else {}),
        "passes": {"mok": len(moks), "torch": len(tors)},
        "flops": "2 * real routed rows * N * K (padding rows not counted); fc1 = x . W1^T with N = 2*inter "
                 "(mok also applies SwiGLU and stores h and gate/up; torch only the product); dgrad_swiglu = "
                 "d_y . W_down with N = inter (mok also applies the SwiGLU backward and stores d_gu; "
                 "torch_grouped_mm only the product, torch_dgrad_swiglu the product + torch elementwise ops)",
        "cases": cases,
    }
    json.dump(res, open(a.out, "w"), indent=1)
    if a.fp8_out:
        json.dump({**res, "cases": [c for c in cases if c["precision"] == "fp8"]}, open(a.fp8_out, "w"), indent=1)
    print(f"{res['device']}  peak (cuBLAS 8192^3) {res['peak_bf16_tflops']} TFLOP/s")
    # t+swiglu: torch's GEMM with the SwiGLU (fc1) or the SwiGLU backward (dgrad_swiglu) in torch
    # ops, the same work as mok's fused form; x+: mok against it.
    print(f"{'case':<34}{'rows':>5} {'routing':<8}{'mok':>8}{'torch':>8}{'x':>7}{'t+swiglu':>9}{'x+':>6}{'err':>10}")
    nan = float("nan")
    for c in cases:
        t = c["torch_grouped_mm_tflops"]
        ts = c.get("torch_fc1_swiglu_tflops") or c.get("torch_dgrad_swiglu_tflops")
        print(f"{c['name']:<34}{c['rows_per_expert']:>5} {c['routing']:<8}{c['mok_tflops']:>8.1f}"
              f"{(t if t is not None else nan):>8.1f}{(c['speedup'] or nan):>7.2f}"
              f"{(ts if ts is not None else nan):>9.1f}{(c['mok_tflops'] / ts if ts else nan):>6.2f}"
              f"{c['check_rel_err']:>10.1e}")


if __name__ == "__main__":
    main()
