#!/usr/bin/env python3
"""Merges mok_gemm_bench's and torch_baseline.py's JSON (same device call) into
bench/results/gemm-h200x1.json and prints the table.

  python3 bench/gemm/make_json.py --mok mok.json --torch torch.json --out gemm-h200x1.json \
      [--commit SHA] [--date YYYY-MM-DD]
"""
import argparse
import datetime
import json
import subprocess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mok", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit")
    ap.add_argument("--date")
    a = ap.parse_args()
    mok = json.load(open(a.mok))
    tor = json.load(open(a.torch))
    commit = a.commit
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"
    tmap = {(c["name"], c["rows_per_expert"], c["routing"]): c for c in tor["cases"]}
    cases = []
    for c in mok["cases"]:
        t = tmap.get((c["name"], c["rows_per_expert"], c["routing"]), {})
        tt = t.get("torch_tflops")
        cases.append({
            "name": c["name"], "form": c["form"], "rows_per_expert": c["rows_per_expert"],
            "routing": c["routing"], "mok_tflops": round(c["mok_tflops"], 1),
            "torch_grouped_mm_tflops": None if tt is None else round(tt, 1),
            "speedup": None if not tt else round(c["mok_tflops"] / tt, 3),
            "mok_ms": c["mok_ms"], "torch_ms": t.get("torch_ms"),
            "experts": c["experts"], "n": c["n"], "k": c["k"], "m": c["m"],
            "check_rel_err": c["check_rel_err"],
            **({"torch_fc1_swiglu_tflops": round(t["torch_fc1_swiglu_tflops"], 1)}
               if "torch_fc1_swiglu_tflops" in t else {}),
            **({"torch_error": t["torch_error"]} if "torch_error" in t else {}),
        })
    res = {
        "device": mok["device"], "gpus": 1,
        "date": a.date or datetime.date.today().isoformat(),
        "commit": commit, "torch": tor.get("torch"),
        "peak_bf16_tflops": round(tor["peak_bf16_tflops"], 1),
        "flops": "2 * real routed rows * N * K (padding rows not counted); fc1 = x . W1^T with N = 2*inter "
                 "(mok also applies SwiGLU and stores h and gate/up; torch only the product)",
        "cases": cases,
    }
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"{res['device']}  peak (cuBLAS 8192^3) {res['peak_bf16_tflops']} TFLOP/s")
    print(f"{'case':<26}{'rows':>5} {'routing':<8}{'mok':>8}{'torch':>8}{'x':>7}{'t+swiglu':>9}{'err':>10}")
    for c in cases:
        t = c["torch_grouped_mm_tflops"]
        ts = c.get("torch_fc1_swiglu_tflops")
        print(f"{c['name']:<26}{c['rows_per_expert']:>5} {c['routing']:<8}{c['mok_tflops']:>8.1f}"
              f"{(t if t is not None else float('nan')):>8.1f}{(c['speedup'] or float('nan')):>7.2f}"
              f"{(ts if ts is not None else float('nan')):>9.1f}{c['check_rel_err']:>10.1e}")


if __name__ == "__main__":
    main()
