#!/usr/bin/env python3
"""Writes the memory results file of issue 19 (bench/results/memory-<gpu>x<n>.json) from the
layer's memory plan, and prints it as a table.

usage: memory_report.py --out OUT_JSON --device DEVICE --commit COMMIT [--date YYYY-MM-DD]
                        [--plan-json PLAN_JSON | --plan-bin MOK_MEMORY_PLAN] [--sm-count N]
                        [--mok-json MOK_JSON] [--baseline-json BASELINE_JSON] [--layers 58]

The plan is mok_memory_plan's JSON (bench/memory/memory_plan_cli.cpp: mok::plan_memory for rank 0
of each model at T = 8192 and EP 1, 2, 8, default Config); without --plan-json the binary
(default build/release/bench/mok_memory_plan) is run. OUT_JSON is
  {device, date, commit, sm_count, cases: [{model, ep, T, routing, mode, workspace_bytes,
   persistent_bytes_per_layer, saved_bytes_per_forward, baseline_saved_bytes, measured_bytes,
   backward_ok}]}
one case per plan case and routing (uniform, zipf, one-expert), mode "saved". From the plan:
  persistent_bytes_per_layer  scope Layer (the symmetric windows included) plus scope Backward:
                              with the default Config (share_workspace off) the backward's buffers
                              (dy_rows, ...) are allocated by each layer and held for its life;
  saved_bytes_per_forward     scope Saved (the published routing, the combine slots, the schedule,
                              and the routed x rows, gate/up pre-activations and h where the
                              backward reads them rather than recomputing them);
  workspace_bytes             0: the default Config shares nothing between layers;
  backward_ok                 whether the backward runs on the megakernel path at that shape: it
                              reads every routed row of the forward, so the forward's ring must
                              hold the worst case (ring_rows >= worst_case_rows); null when the
                              plan has no ring or failed.
The planner sizes every buffer for the worst case of the routing, so these fields are the same for
every routing; the routings differ only in the measurements. Measurements are joined, never made
up (null where absent): measured_bytes from MOK_JSON (mok_bench's cases whose `memory` object holds
`measured_bytes`), baseline_saved_bytes from BASELINE_JSON (torch_moe_baseline.py's `saved_bytes`,
what its forward keeps for the backward). A measurement joins on (model, ep, T, routing): the
case's `ep`, else the file's, else 1; per-rank slices ("dsv3/ep8") are different shapes and never
join; mok cases of a variant other than the megakernel neither.
The table ends, per model, with the footprint of `--layers` layers at EP 8:
(persistent + saved) x layers + workspace.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

ROUTINGS = ("uniform", "zipf", "one-expert")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BIN = os.path.join(HERE, "..", "build", "release", "bench", "mok_memory_plan")


def load_plan(a):
    if a.plan_json:
        with open(a.plan_json) as f:
            return json.load(f)
    run = subprocess.run([a.plan_bin, "--sm-count", str(a.sm_count)], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{a.plan_bin} failed (rc {run.returncode}): {run.stderr.strip()}")
    return json.loads(run.stdout)


def measurements(path, value, skip=lambda case: False):
    """{(model, ep, T, routing): value(case)} of a results file's cases where value() is not None;
    {} without a file."""
    if not path:
        return {}
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for c in doc.get("cases", []):
        if "/" in str(c.get("model", "")) or skip(c):
            continue
        v = value(c)
        if v is not None:
            out[(c["model"], int(c.get("ep", doc.get("ep", 1))), int(c["T"]), c["routing"])] = int(v)
    return out


def build_cases(plan, measured, baseline, pool=None):
    cases = []
    for p in plan["cases"]:
        t = p.get("totals")
        ring, worst = p.get("ring_rows"), p.get("worst_case_rows")
        for routing in ROUTINGS:
            key = (p["model"], int(p["ep"]), int(p["T"]), routing)
            case = {"model": p["model"], "ep": p["ep"], "T": p["T"], "routing": routing, "mode": "saved",
                    "workspace_bytes": 0 if t else None,
                    "persistent_bytes_per_layer": t["layer"] + t["backward"] if t else None,
                    "saved_bytes_per_forward": t["saved"] if t else None,
                    "baseline_saved_bytes": baseline.get(key),
                    "measured_bytes": measured.get(key),
                    # "new": the measurement holds the windows; "pool": it does not (an earlier
                    # layer's were reused); "unknown": the results file does not say; null: none.
                    "measured_windows": None if key not in measured else
                    {1: "pool", 0: "new"}.get((pool or {}).get(key), "unknown"),
                    "backward_ok": (ring >= worst) if ring is not None and worst is not None else None}
            if "error" in p:
                case["plan_error"] = p["error"]
            cases.append(case)
    return cases


def gb(v):
    return "-" if v is None else f"{v / 1e9:.3f}"


def ok_text(v):
    return "-" if v is None else str(v).lower()


def table(cases, layers):
    rows = ["| model | ep | routing | persistent GB | saved GB | workspace GB | baseline saved GB | "
            "measured GB | backward_ok |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        ok = ok_text(c["backward_ok"])
        rows.append(f"| {c['model']} | {c['ep']} | {c['routing']} | {gb(c['persistent_bytes_per_layer'])} | "
                    f"{gb(c['saved_bytes_per_forward'])} | {gb(c['workspace_bytes'])} | "
                    f"{gb(c['baseline_saved_bytes'])} | {gb(c['measured_bytes'])} | {ok} |")
    rows.append("")
    seen = set()
    for c in cases:  # the plan's fields do not depend on the routing: one line per model
        if c["ep"] != 8 or c["model"] in seen or c["persistent_bytes_per_layer"] is None:
            continue
        seen.add(c["model"])
        total = (c["persistent_bytes_per_layer"] + c["saved_bytes_per_forward"]) * layers + c["workspace_bytes"]
        rows.append(f"{c['model']}: {layers} layers at EP 8: {gb(total)} GB per GPU "
                    f"(({gb(c['persistent_bytes_per_layer'])} + {gb(c['saved_bytes_per_forward'])}) x {layers}"
                    f" + {gb(c['workspace_bytes'])}); backward on the megakernel path: {ok_text(c['backward_ok'])}")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description="memory results file (issue 19) from mok's memory plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", required=True, help='e.g. "NVIDIA H200"')
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--plan-json", help="mok_memory_plan's output (else the binary is run)")
    ap.add_argument("--plan-bin", default=DEFAULT_BIN)
    ap.add_argument("--sm-count", type=int, default=132, help="passed to the binary")
    ap.add_argument("--mok-json", help="mok_bench results (memory.measured_bytes)")
    ap.add_argument("--baseline-json", help="torch_moe_baseline.py results: saved_bytes")
    ap.add_argument("--layers", type=int, default=58, help="layers of the footprint line (default 58)")
    a = ap.parse_args(argv)
    plan = load_plan(a)
    mk_only = lambda c: c.get("variant", "megakernel") != "megakernel"  # noqa: E731
    measured = measurements(a.mok_json, lambda c: (c.get("memory") or {}).get("measured_bytes"), skip=mk_only)
    # Whether each measurement holds the layer's symmetric windows (mok_bench's windows_from_pool;
    # older files do not say).
    pool = measurements(a.mok_json, lambda c: {True: 1, False: 0}.get((c.get("memory") or {}).get("windows_from_pool"))
                        if (c.get("memory") or {}).get("measured_bytes") is not None else None, skip=mk_only)
    baseline = measurements(a.baseline_json, lambda c: c.get("saved_bytes"))
    doc = {"device": a.device, "date": a.date, "commit": a.commit, "sm_count": plan.get("sm_count"),
           "cases": build_cases(plan, measured, baseline, pool)}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(table(doc["cases"], a.layers))


if __name__ == "__main__":
    main()
