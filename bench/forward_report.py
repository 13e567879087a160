#!/usr/bin/env python3
"""Joins mok_bench's GPU forward results with the PyTorch+NCCL baseline of the same run into one
results file (bench/results/forward-<gpu>x<n>.json) and prints the comparison tables.

usage: forward_report.py [--fp8 MOK_FP8_JSON]... MOK_JSON BASELINE_JSON OUT_JSON [GPU_SAMPLES_CSV]

MOK_JSON holds `cases` (one per model, T, routing, at mok's default settings) and optionally
`ablation` (the same cases under other variants / comm SMs / minibatch / macrobatch sizes). Both
are copied to OUT_JSON; every case and ablation entry whose (model, T, routing) the baseline also
ran gets `baseline_ms` and `speedup` (= baseline_ms / mok's ms). If BASELINE_JSON is missing,
empty or unreadable, OUT_JSON still gets written with mok's numbers only (no baseline fields).

Cases that mok_bench measured with --sustain also carry `mok_sustained_ms` / `mok_sustained_tflops`
(the slowest rank's mean time per forward over seconds of back-to-back forwards, at the power cap); when the
baseline ran with --sustain too, `baseline_sustained_ms` and `sustained_speedup` join them.

--fp8 (repeatable): mok_bench's run of the same cases in FP8 (--precision fp8, the FP8 megakernel; or
--precision mxfp8, its MXFP8 variant): its cases join OUT_JSON's `cases` with their `precision` ("fp8",
"mxfp8"; mok's own cases get "bf16" where they carry none),
the same baseline fields, and `bf16_mok_ms` / `x_bf16` (mok's bf16 time of the same case over the
FP8 one). Readers that want one entry per (model, T, routing) take the bf16 ones. An FP8 case's
`mok_pct_of_peak` and `mok_sustained_pct_of_sustained_peak` are against the baseline's `peak_fp8`
(cuBLAS FP8 8192^3, same run; absent when not measured), never against the bf16 peak; FP8 cases
get no backward fields (the main job's FP8 pass is the FP8 megakernel, forward only; the FP8
backward runs on the unfused path: bench/fp8_layer_device.sh, fp8-layer-backward-h200x1.json).

Backward: cases with `mok_bwd_ms` (mok_bench's backward of the main variant) get, when the
baseline timed its backward too (`baseline_bwd_ms`), `baseline_bwd_tflops`, `bwd_speedup` and
`mok_bwd_pct_of_peak`; a second table shows them.

Against the hardware: when the baseline carries `peak_bf16` (cuBLAS dense bf16 8192^3 on every GPU
in the same run, burst and sustained), OUT_JSON gets it and each case `mok_pct_of_peak` (mok's
TFLOP/s over the largest burst peak, in %), `baseline_pct_of_peak`, and with sustained figures
`mok_sustained_pct_of_sustained_peak`. mok_bench's own `nvlink_copy_ceiling_GBps` (and each
case's `mok_nvlink_GBps` / `nvlink_fraction_of_ceiling`) are carried through.

GPU_SAMPLES_CSV (optional; scripts/run.sh writes it): nvidia-smi samples taken while mok_bench
ran, one line per GPU and sample: `index, utilization.gpu %, clocks.sm MHz, power.draw W,
power.limit W, clock event reasons (hex bitmask)`. OUT_JSON then gets `gpu_samples`: per GPU,
over the samples under load (>= 90% utilization and >= half the power limit: a kernel spinning
on a flag, e.g. one rank waiting for the other's host work, keeps utilization at 100% at low
power and full clock), the median SM clock and power draw, the power limit, and the share of
those samples in which the software power cap (0x4) or a hardware slowdown (0x8 | 0x40 | 0x80)
held the clock down. Sustained clocks explain the gap
between burst-clock peaks (cuBLAS, the standalone GEMM) and the layer's rate.
"""
import json
import math
import os
import sys


def case_key(entry):
    return (entry["model"], entry["T"], entry["routing"])


def precision_of(entry):
    return entry.get("precision", "bf16")


def bf16_rows(cases):
    """The bf16 cases (the FP8 ones have their own table, print_fp8)."""
    return [c for c in cases if precision_of(c) == "bf16"]


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


def pct(row, key, value, reference):
    """row[key] = 100 * value / reference, when both are positive numbers."""
    if isinstance(value, (int, float)) and isinstance(reference, (int, float)) and value > 0 and reference > 0:
        row[key] = 100.0 * value / reference


def join(mok, base, fp8_docs=()):
    """The output document: mok's cases and ablation, each joined with the baseline when known;
    `fp8_docs` (mok_bench's FP8 / MXFP8 runs of the same cases) add their cases, beside the bf16 ones."""
    by_key = {case_key(c): c for c in base["cases"]} if base else {}
    peak = (base or {}).get("peak_bf16") or {}
    peak_fp8 = (base or {}).get("peak_fp8") or {}
    cases = []
    bf16_ms = {case_key(c): c.get("mok_ms") for c in mok["cases"] if precision_of(c) == "bf16"}
    for c in list(mok["cases"]) + [c for d in fp8_docs for c in (d.get("cases") or [])]:
        row = dict(c)
        row["precision"] = precision_of(c)
        bf16 = row["precision"] == "bf16"
        # Each precision against its own dense peak of the same run (FP8: cuBLAS FP8, when measured).
        p = peak if bf16 else peak_fp8
        burst_peak, sustained_peak = p.get("burst_tflops_max"), p.get("sustained_tflops_max")
        if row["precision"] != "bf16" and bf16_ms.get(case_key(c)) and c.get("mok_ms"):
            row["bf16_mok_ms"] = bf16_ms[case_key(c)]
            row["x_bf16"] = bf16_ms[case_key(c)] / c["mok_ms"]
        b = by_key.get(case_key(c))
        if b:
            row["baseline_ms"] = b["baseline_ms"]
            row["baseline_tflops"] = b["baseline_tflops"]
            s = speedup(b["baseline_ms"], c["mok_ms"])
            if s is not None:
                row["speedup"] = s
            if "baseline_bwd_ms" in b and bf16:  # the baseline's backward (not beside the FP8 pass: forward only)
                row["baseline_bwd_ms"] = b["baseline_bwd_ms"]
                row["baseline_bwd_tflops"] = b.get("baseline_bwd_tflops")
                s = speedup(b["baseline_bwd_ms"], c.get("mok_bwd_ms"))
                if s is not None:
                    row["bwd_speedup"] = s
            if "baseline_sustained_ms" in b:  # torch_moe_baseline.py --sustain
                row["baseline_sustained_ms"] = b["baseline_sustained_ms"]
                row["baseline_sustained_tflops"] = b.get("baseline_sustained_tflops")
                s = speedup(b["baseline_sustained_ms"], c.get("mok_sustained_ms"))
                if s is not None:
                    row["sustained_speedup"] = s
        pct(row, "mok_pct_of_peak", row.get("mok_tflops"), burst_peak)
        if bf16:
            pct(row, "baseline_pct_of_peak", row.get("baseline_tflops"), burst_peak)
        pct(row, "mok_sustained_pct_of_sustained_peak", row.get("mok_sustained_tflops"), sustained_peak)
        pct(row, "mok_bwd_pct_of_peak", row.get("mok_bwd_tflops"), burst_peak)
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
    for k in ("nvlink_copy_ceiling_GBps", "nvlink_copy_method", "nvlink_copy_rates"):
        if k in mok:
            out[k] = mok[k]
    if peak:
        out["peak_bf16"] = peak
    if peak_fp8:
        out["peak_fp8"] = peak_fp8
    if base:
        out["what"] = mok.get("what", "") + "; baseline: " + base.get("what", "")
        out["baseline_torch"] = base.get("torch")
        out["baseline_nccl"] = base.get("nccl")
    else:
        out["what"] = mok.get("what", "") + "; baseline: not available"
    out["cases"] = cases
    out["ablation"] = ablation
    return out


# Clock event reason bits (nvidia-smi --help-query-gpu).
POWER_CAP = 0x4
HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # hardware slowdown, hardware thermal, power brake


def median(values):
    v = sorted(values)
    n = len(v)
    return None if n == 0 else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def gpu_samples(path, busy_util=90.0, busy_power_share=0.5):
    """Per-GPU summary of nvidia-smi samples (see the module doc), or None when unusable."""
    per_gpu = {}
    try:
        with open(path) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) < 6:
                    continue
                try:
                    gpu, util, clock, power, limit = (int(parts[0]), float(parts[1]), float(parts[2]),
                                                      float(parts[3]), float(parts[4]))
                    reasons = int(parts[5], 16)
                except ValueError:
                    continue  # header or "[N/A]"
                per_gpu.setdefault(gpu, []).append((util, clock, power, limit, reasons))
    except OSError as e:
        print(f"forward_report: GPU samples {path} cannot be read ({e})", file=sys.stderr)
        return None
    out = []
    for gpu in sorted(per_gpu):
        busy = [s for s in per_gpu[gpu] if s[0] >= busy_util and s[2] >= busy_power_share * s[3]]
        if not busy:
            continue
        out.append({"gpu": gpu, "busy_samples": len(busy),
                    "sm_clock_mhz_median": median([s[1] for s in busy]),
                    "power_w_median": median([s[2] for s in busy]),
                    "power_limit_w": max(s[3] for s in busy),
                    "power_capped_share": sum(1 for s in busy if s[4] & POWER_CAP) / len(busy),
                    "hw_slowdown_share": sum(1 for s in busy if s[4] & HW_SLOWDOWN) / len(busy)})
    return out or None


def print_gpu_samples(out):
    if not out.get("gpu_samples"):
        return
    print("\nGPU clock and power while mok_bench ran (samples under load: >= 90% utilization, >= half the power limit)")
    print("| GPU | samples | SM clock MHz (median) | power W (median) | power limit W | power-capped | HW slowdown |")
    print("|---|---|---|---|---|---|---|")
    for g in out["gpu_samples"]:
        print(f"| {g['gpu']} | {g['busy_samples']} | {g['sm_clock_mhz_median']:.0f} | {g['power_w_median']:.0f} "
              f"| {g['power_limit_w']:.0f} | {100 * g['power_capped_share']:.0f}% | {100 * g['hw_slowdown_share']:.0f}% |")


def fmt(value, spec, suffix=""):
    """`value` formatted with `spec`, or a dash when it is absent or not a number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def print_cases(out):
    print(f"\nForward, {out['gpus']} x {out['device']}, EP {out['ep']} (commit {out['commit']})")
    # mok_bench --sustain: the same median after seconds of back-to-back forwards (power-capped)
    sustained = any("mok_sustained_ms" in c or "baseline_sustained_ms" in c for c in out["cases"])
    extra_head = (" mok sustained ms | sustained TFLOP/s/GPU | baseline sustained ms | sustained speedup |"
                  if sustained else "")
    print("| model | T/rank | routing | mok ms | baseline ms | speedup | mok TFLOP/s/GPU | baseline TFLOP/s/GPU |"
          + extra_head)
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if sustained else ""))
    for c in bf16_rows(out["cases"]):
        extra = (f" {fmt(c.get('mok_sustained_ms'), '.3f')} | {fmt(c.get('mok_sustained_tflops'), '.0f')} "
                 f"| {fmt(c.get('baseline_sustained_ms'), '.3f')} | {fmt(c.get('sustained_speedup'), '.2f', 'x')} |"
                 if sustained else "")
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {fmt(c['mok_ms'], '.3f')} "
              f"| {fmt(c.get('baseline_ms'), '.3f')} | {fmt(c.get('speedup'), '.2f', 'x')} "
              f"| {fmt(c.get('mok_tflops'), '.0f')} | {fmt(c.get('baseline_tflops'), '.0f')} |" + extra)


def print_backward(out):
    rows = [c for c in bf16_rows(out["cases"]) if "mok_bwd_ms" in c or "baseline_bwd_ms" in c]
    if not rows:
        return
    # The same backward adding the weight gradients into fp32 main_grad (mok_bench's ablation), when timed.
    acc = any("mok_bwd_accumulate_ms" in c for c in rows)
    print("\nBackward (mok: the layer's backward kernels after the forward, over windows of the ring when it "
          "is below the worst case; FLOPs twice the forward's" +
          ("; fp32 main_grad: the same backward adding the weight gradients into fp32 ones" if acc else "") + ")")
    print("| model | T/rank | routing | mok ms | baseline ms | speedup | mok TFLOP/s/GPU | % of peak "
          "| baseline TFLOP/s/GPU | check |" + (" fp32 main_grad ms |" if acc else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if acc else ""))
    for c in rows:
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {fmt(c.get('mok_bwd_ms'), '.3f')} "
              f"| {fmt(c.get('baseline_bwd_ms'), '.3f')} | {fmt(c.get('bwd_speedup'), '.2f', 'x')} "
              f"| {fmt(c.get('mok_bwd_tflops'), '.0f')} | {fmt(c.get('mok_bwd_pct_of_peak'), '.1f', '%')} "
              f"| {fmt(c.get('baseline_bwd_tflops'), '.0f')} | {fmt(c.get('bwd_check_rel_err'), '.1e')} |" +
              (f" {fmt(c.get('mok_bwd_accumulate_ms'), '.3f')} |" if acc else ""))


def print_hardware(out):
    """Each case against the measured bf16 peak and the NVLink copy ceiling of the same run."""
    peak = out.get("peak_bf16") or {}
    ceiling = out.get("nvlink_copy_ceiling_GBps")
    if not peak and not ceiling:
        return
    burst = ", ".join(f"{v:.0f}" for v in peak.get("burst_tflops", []))
    sus = ", ".join(f"{v:.0f}" for v in peak.get("sustained_tflops", []))
    print(f"\nAgainst the hardware, same run: bf16 peak (cuBLAS 8192^3) burst {burst or '-'} TFLOP/s, "
          f"sustained {sus or '-'} TFLOP/s per GPU (percentages of the largest); NVLink copy ceiling "
          f"{fmt(ceiling, '.0f', ' GB/s')}")
    print("| model | T/rank | routing | mok TFLOP/s/GPU | % of peak | sustained TFLOP/s | % of sustained peak "
          "| baseline % of peak | NVLink GB/s per direction | % of ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in bf16_rows(out["cases"]):
        frac = c.get("nvlink_fraction_of_ceiling")
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {fmt(c.get('mok_tflops'), '.0f')} "
              f"| {fmt(c.get('mok_pct_of_peak'), '.1f', '%')} | {fmt(c.get('mok_sustained_tflops'), '.0f')} "
              f"| {fmt(c.get('mok_sustained_pct_of_sustained_peak'), '.1f', '%')} "
              f"| {fmt(c.get('baseline_pct_of_peak'), '.1f', '%')} | {fmt(c.get('mok_nvlink_GBps'), '.0f')} "
              f"| {fmt(100 * frac if frac is not None else None, '.0f', '%')} |")


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


def held_gb(memory):
    """What a layer holds besides the workspace its layers share (mok_bench's `memory` object)."""
    if not isinstance(memory, dict) or memory.get("total_bytes") is None:
        return None
    return (memory["total_bytes"] - (memory.get("workspace_bytes") or 0)) / 1e9


def print_memory_modes(out):
    """The backward of the main variant (its memory mode) next to the other memory modes and backward
    paths timed in the same run (ablation entries with bwd_ms): time and memory per layer."""
    modes = [a for a in out["ablation"] if a.get("bwd_ms") is not None]
    if not modes:
        return
    mains = {case_key(c): c for c in bf16_rows(out["cases"])}
    print("\nBackward by memory mode, same run (held: per layer, besides a shared workspace)")
    print("| model | T/rank | routing | mode | ring | bwd ms | vs main | held GB | workspace GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, entries in ablation_groups(modes).items():
        c = mains.get(key)
        # The main variant's mode (results files before the training default: always resident),
        # and its backward path when it is the GEMM program.
        main_mode = ((c.get("memory") or {}).get("mode") or "resident") if c else ""
        if c and c.get("backward_path") == "fused":
            main_mode += " (fused backward)"
        rows = ([(main_mode, c.get("macrobatch_tokens"), c.get("mok_bwd_ms"), c.get("memory"))] if c else []) + \
            [(a["variant"].replace("megakernel-training-", "").replace("megakernel-", ""), a.get("macrobatch_tokens"),
              a["bwd_ms"], a.get("memory")) for a in entries]
        base = c.get("mok_bwd_ms") if c else None
        for mode, ring, ms, mem in rows:
            ws = mem.get("workspace_bytes") if isinstance(mem, dict) else None
            rel = ms / base if base and ms else None
            print(f"| {key[0]} | {key[1]} | {key[2]} | {mode} | {fmt(ring, '')} | {fmt(ms, '.3f')} "
                  f"| {fmt(rel, '.2f', 'x')} | {fmt(held_gb(mem), '.2f')} | {fmt(ws / 1e9 if ws else None, '.2f')} |")


def print_fp8(out):
    rows = [c for c in out["cases"] if precision_of(c) != "bf16"]
    if not rows:
        return
    peak = out.get("peak_fp8") or {}
    burst = ", ".join(f"{v:.0f}" for v in peak.get("burst_tflops", []))
    sus = ", ".join(f"{v:.0f}" for v in peak.get("sustained_tflops", []))
    print(f"\nForward in FP8 (x bf16: the bf16 forward's time over this one; % of the FP8 peak, same run: "
          f"cuBLAS FP8 8192^3 burst {burst or '-'}, sustained {sus or '-'} TFLOP/s per GPU)")
    print("| model | T | routing | precision | mok ms | bf16 mok ms | x bf16 | baseline ms | speedup "
          "| TFLOP/s/GPU | % of FP8 peak | sustained TFLOP/s | % of sustained FP8 peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        print(f"| {c['model']} | {c['T']} | {c['routing']} | {c['precision']} | {fmt(c.get('mok_ms'), '.3f')} | "
              f"{fmt(c.get('bf16_mok_ms'), '.3f')} | {fmt(c.get('x_bf16'), '.2f', 'x')} | "
              f"{fmt(c.get('baseline_ms'), '.3f')} | {fmt(c.get('speedup'), '.2f', 'x')} "
              f"| {fmt(c.get('mok_tflops'), '.0f')} | {fmt(c.get('mok_pct_of_peak'), '.1f', '%')} "
              f"| {fmt(c.get('mok_sustained_tflops'), '.0f')} "
              f"| {fmt(c.get('mok_sustained_pct_of_sustained_peak'), '.1f', '%')} |")


def main(argv):
    fp8 = []
    while len(argv) >= 2 and argv[0] == "--fp8":
        try:
            with open(argv[1]) as f:
                fp8.append(json.load(f))
        except (OSError, ValueError) as e:  # reported; the bf16 report still gets written
            print(f"forward_report: no FP8 results from {argv[1]}: {e}", file=sys.stderr)
        argv = argv[2:]
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mok_path, base_path, out_path = argv[:3]
    with open(mok_path) as f:
        mok = json.load(f)
    out = join(mok, load_baseline(base_path), fp8)
    if len(argv) == 4:
        samples = gpu_samples(argv[3])
        if samples:
            out["gpu_samples"] = samples
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print_cases(out)
    print_fp8(out)
    print_backward(out)
    print_hardware(out)
    print_ablation(out)
    print_memory_modes(out)
    print_gpu_samples(out)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
