#!/usr/bin/env python3
"""Writes the memory results file of issue 19 (bench/results/memory-<gpu>x<n>.json) from the
layer's memory plan, and prints it as a table.

usage: memory_report.py --out OUT_JSON --device DEVICE --commit COMMIT [--date YYYY-MM-DD]
                        [--plan-json PLAN_JSON | --plan-bin MOK_MEMORY_PLAN] [--sm-count N]
                        [--mok-json MOK_JSON ...] [--baseline-json BASELINE_JSON] [--layers 58]
                        [--measured-commit C]

The plan is mok_memory_plan's JSON (bench/memory/memory_plan_cli.cpp: mok::plan_memory for rank 0
of each model at T = 8192 and EP 1, 2, 8, in the modes resident / saved / recompute); without
--plan-json the binary (default build/release/bench/mok_memory_plan) is run. OUT_JSON is
  {device, date, commit, sm_count, workspace_budget_bytes, precision, [measured_commit,]
   cases: [{model, ep, T, routing, mode, ring_rows, workspace_bytes,
   persistent_bytes_per_layer, saved_bytes_per_forward, baseline_saved_bytes, measured_bytes,
   backward_ok}]}
one case per plan case (a mode; plan files without modes are "resident") and routing (uniform,
zipf, one-expert). From the plan:
  workspace_bytes             the buffers the layers on a communicator share (Config::
                              share_workspace; 0 without it): counted once per GPU;
  saved_bytes_per_forward     scope Saved (the published routing, the combine slots, the schedule,
                              and the gate/up pre-activations and routed rows the backward reads
                              rather than recomputes);
  persistent_bytes_per_layer  the rest of one layer's own buffers (scope Layer, the symmetric
                              windows included, and scope Backward, held from the first backward);
  backward_ok                 whether the backward runs on the megakernel path at that shape: since
                              the backward over windows of a ring below the worst case, wherever
                              the plan has a ring and a backward (the FP8 megakernel with a resident
                              ring has none: backward_mode "none"); null when the plan failed.
The planner sizes every buffer by the worst case or a budget, so these fields are the same for
every routing; the routings differ only in the measurements. Measurements are joined, never made
up (null where absent): measured_bytes from MOK_JSON (mok_bench's cases whose `memory` object holds
`measured_bytes`, in the mode its `memory.mode` says, "resident" when it says none),
baseline_saved_bytes from BASELINE_JSON (torch_moe_baseline.py's `saved_bytes`, what its forward
keeps for the backward; every mode). A measurement joins on (model, ep, T, routing): the case's
`ep`, else the file's, else 1; per-rank slices ("dsv3/ep8") are different shapes and never join;
mok cases of a variant other than the megakernel neither.
The table ends, per model and mode, with the footprint of `--layers` layers at EP 8:
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


def measurements(paths, value, skip=lambda case: False, with_mode=False):
    """{(model, ep, T, routing[, mode]): value(case)} of the results files' cases where value() is not
    None (a path or a list of them; a later file's case replaces an earlier one's); {} without one."""
    if not paths:
        return {}
    if isinstance(paths, str):
        paths = [paths]
    out = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        out.update(file_measurements(doc, value, skip, with_mode))
    return out


def file_measurements(doc, value, skip, with_mode):
    out = {}
    for c in doc.get("cases", []):
        if "/" in str(c.get("model", "")) or skip(c):
            continue
        v = value(c)
        if v is not None:
            key = (c["model"], int(c.get("ep", doc.get("ep", 1))), int(c["T"]), c["routing"])
            if with_mode:
                key += ((c.get("memory") or {}).get("mode", "resident"),)
            out[key] = int(v)
    return out


def build_cases(plan, measured, baseline, pool=None):
    cases = []
    for p in plan["cases"]:
        t = p.get("totals")
        mode = p.get("mode", "resident")
        saved = t["saved"] if t else None
        per_layer = t.get("per_layer", t["total"]) if t else None
        for routing in ROUTINGS:
            key = (p["model"], int(p["ep"]), int(p["T"]), routing)
            mkey = key + (mode,)
            case = {"model": p["model"], "ep": p["ep"], "T": p["T"], "routing": routing, "mode": mode,
                    "ring_rows": p.get("ring_rows"),
                    "workspace_bytes": t.get("workspace", 0) if t else None,
                    "persistent_bytes_per_layer": per_layer - saved if t else None,
                    "saved_bytes_per_forward": saved,
                    "baseline_saved_bytes": baseline.get(key),
                    "measured_bytes": measured.get(mkey),
                    # "new": the measurement holds the windows; "pool": it does not (an earlier
                    # layer's were reused); "unknown": the results file does not say; null: none.
                    "measured_windows": None if mkey not in measured else
                    {1: "pool", 0: "new"}.get((pool or {}).get(mkey), "unknown"),
                    # (the FP8 megakernel with a resident ring plans no backward: mode "none")
                    "backward_ok": (p.get("ring_rows") is not None and p.get("backward_mode") != "none")
                    if t else None}
            if "error" in p:
                case["plan_error"] = p["error"]
            cases.append(case)
    return cases


def gb(v):
    return "-" if v is None else f"{v / 1e9:.3f}"


def ok_text(v):
    return "-" if v is None else str(v).lower()


def table(cases, layers):
    rows = ["| model | ep | mode | routing | persistent GB | saved GB | workspace GB | baseline saved GB | "
            "measured GB | backward_ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        ok = ok_text(c["backward_ok"])
        rows.append(f"| {c['model']} | {c['ep']} | {c['mode']} | {c['routing']} | "
                    f"{gb(c['persistent_bytes_per_layer'])} | {gb(c['saved_bytes_per_forward'])} | "
                    f"{gb(c['workspace_bytes'])} | {gb(c['baseline_saved_bytes'])} | {gb(c['measured_bytes'])} | {ok} |")
    rows.append("")
    seen = set()
    for c in cases:  # the plan's fields do not depend on the routing: one line per model and mode
        if c["ep"] != 8 or (c["model"], c["mode"]) in seen or c["persistent_bytes_per_layer"] is None:
            continue
        seen.add((c["model"], c["mode"]))
        total = (c["persistent_bytes_per_layer"] + c["saved_bytes_per_forward"]) * layers + c["workspace_bytes"]
        rows.append(f"{c['model']} ({c['mode']}): {layers} layers at EP 8: {gb(total)} GB per GPU "
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
    ap.add_argument("--mok-json", action="append", help="mok_bench results (memory.measured_bytes); repeat "
                    "for several runs (e.g. the training default and --workspace-budget 0's resident mode)")
    ap.add_argument("--baseline-json", help="torch_moe_baseline.py results: saved_bytes")
    ap.add_argument("--layers", type=int, default=58, help="layers of the footprint line (default 58)")
    ap.add_argument("--measured-commit", help="the commit the measurements ran at, when not --commit's "
                    "(only for plans that commit did not change)")
    a = ap.parse_args(argv)
    plan = load_plan(a)
    mk_only = lambda c: c.get("variant", "megakernel") != "megakernel"  # noqa: E731
    measured = measurements(a.mok_json, lambda c: (c.get("memory") or {}).get("measured_bytes"), skip=mk_only,
                            with_mode=True)
    # Whether each measurement holds the layer's symmetric windows (mok_bench's windows_from_pool;
    # older files do not say).
    pool = measurements(a.mok_json, lambda c: {True: 1, False: 0}.get((c.get("memory") or {}).get("windows_from_pool"))
                        if (c.get("memory") or {}).get("measured_bytes") is not None else None, skip=mk_only,
                        with_mode=True)
    baseline = measurements(a.baseline_json, lambda c: c.get("saved_bytes"))
    doc = {"device": a.device, "date": a.date, "commit": a.commit, "sm_count": plan.get("sm_count"),
           "workspace_budget_bytes": plan.get("workspace_budget_bytes"),
           "precision": plan.get("precision", "bf16"),
           "cases": build_cases(plan, measured, baseline, pool)}
    if a.measured_commit:
        doc["measured_commit"] = a.measured_commit
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(table(doc["cases"], a.layers))


if __name__ == "__main__":
    main()
