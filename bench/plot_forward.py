#!/usr/bin/env python3
"""Plots a forward results file written by forward_report.py (bench/results/forward-*.json).

usage: plot_forward.py FORWARD_JSON OUT_PNG

Panels (each left out when the file has no data for it):
  (a) per (model, T, routing) case: mok ms next to the PyTorch+NCCL baseline ms, speedup above;
  (b) ablation: per case, one bar per variant at the case's default point (the entry with the
      case's comm_sms and minibatch_tokens; hatched where no such entry exists and the variant's
      fastest entry is shown instead), the baseline as a black tick;
  (c), (d) sweeps of the "megakernel" variant: ms vs comm SMs at a fixed minibatch, and ms vs
      minibatch tokens at a fixed comm SM count, one line per case.
Times span more than an order of magnitude across models, so the ms axes are logarithmic.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_common  # noqa: E402

SWEEP_VARIANT = "megakernel"


def case_key(entry):
    return (entry["model"], entry["T"], entry["routing"])


def case_label(key, sep="\n"):
    model, t, routing = key
    return f"{model}{sep}T={t}{sep}{routing}"


def groups_in_order(entries):
    """{(model, T, routing): [entries]} in the order the keys first appear."""
    groups = {}
    for e in entries:
        groups.setdefault(case_key(e), []).append(e)
    return groups


def bf16_cases(doc):
    """The bf16 cases (a forward file also holds mok_bench --precision fp8's, with "precision")."""
    return [c for c in doc.get("cases") or [] if c.get("precision", "bf16") == "bf16"]


def fastest(entries):
    return min(entries, key=lambda e: e["ms"])


def default_points(doc):
    """[(case key, {variant: (entry, at_default)}, baseline_ms or None)] for panel (b).

    A variant's bar is its entry at the case's default (comm_sms, minibatch_tokens) — the fastest
    of those when several match, e.g. differing macrobatch sizes — else its fastest entry overall
    (at_default False)."""
    cases = {case_key(c): c for c in bf16_cases(doc)}
    rows = []
    for key, entries in groups_in_order(doc.get("ablation", [])).items():
        case = cases.get(key, {})
        by_variant = {}
        for e in entries:
            by_variant.setdefault(e.get("variant", "?"), []).append(e)
        chosen = {}
        for variant, es in by_variant.items():
            at_default = [e for e in es
                          if "comm_sms" in case and "minibatch_tokens" in case
                          and e.get("comm_sms") == case["comm_sms"]
                          and e.get("minibatch_tokens") == case["minibatch_tokens"]]
            chosen[variant] = (fastest(at_default), True) if at_default else (fastest(es), False)
        baseline = case.get("baseline_ms") or next(
            (e["baseline_ms"] for e in entries if "baseline_ms" in e), None)
        rows.append((key, chosen, baseline))
    return rows


def sweeps(doc, swept, held):
    """{case key: [(x, ms)]} for the megakernel variant with `swept` varying and `held` fixed.

    `held` is fixed at the case's default value when that gives at least two points, else at the
    value that gives the most points. Several entries at one x (e.g. other macrobatch sizes) count
    as their fastest. Cases with fewer than two points are left out."""
    cases = {case_key(c): c for c in bf16_cases(doc)}
    lines = {}
    for key, entries in groups_in_order(doc.get("ablation", [])).items():
        es = [e for e in entries if e.get("variant") == SWEEP_VARIANT
              and swept in e and held in e and e.get("ms")]
        by_held = {}  # held value -> {x: best ms}
        for e in es:
            xs = by_held.setdefault(e[held], {})
            xs[e[swept]] = min(e["ms"], xs.get(e[swept], float("inf")))
        if not by_held:
            continue
        default = cases.get(key, {}).get(held)
        if len(by_held.get(default, {})) >= 2:
            points = by_held[default]
        else:
            points = max(by_held.values(), key=len)
        if len(points) >= 2:
            lines[key] = sorted(points.items())
    return lines


def log_ms_axis(ax):
    """A log y axis for ms with plain-number labels ("4", "0.5") instead of "4x10^0"; minor
    ticks are labelled only when the axis spans few decades (matplotlib's thresholds)."""
    from matplotlib.ticker import LogFormatter
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_ylabel("ms (log scale)")


def plot_cases(ax, cases, mok_key="mok_ms", base_key="baseline_ms", speedup_key="speedup",
               title="(a) forward per case"):
    """mok's and the baseline's time per case (`*_key`: which fields; the backward panel passes its
    own), with the sustained rates of the forward as black bars where present."""
    cases = [c for c in cases if c.get(mok_key)]
    labels = [case_label(case_key(c)) for c in cases]
    xs = range(len(cases))
    width = 0.38
    mok = [c[mok_key] for c in cases]
    base = [c.get(base_key) for c in cases]
    has_base = any(b is not None for b in base)
    offset = width / 2 if has_base else 0.0
    ax.bar([x - offset for x in xs], mok, width, label="mok", color="C0")
    # mok_bench --sustain: the rate at the power cap (seconds of back-to-back forwards), as a
    # black bar across mok's column
    forward = mok_key == "mok_ms"
    sus = [(x - offset, c["mok_sustained_ms"]) for x, c in zip(xs, cases) if forward and c.get("mok_sustained_ms")]
    if sus:
        ax.hlines([m for _, m in sus], [x - width / 2 for x, _ in sus], [x + width / 2 for x, _ in sus],
                  colors="black", linewidth=2, label="mok, sustained (power-capped)")
    if has_base:
        ax.bar([x + offset for x in xs], [b if b is not None else 0 for b in base], width,
               label="PyTorch+NCCL baseline", color="C7")
        bsus = [(x + offset, c["baseline_sustained_ms"]) for x, c in zip(xs, cases)
                if forward and c.get("baseline_sustained_ms")]
        if bsus:
            ax.hlines([m for _, m in bsus], [x - width / 2 for x, _ in bsus],
                      [x + width / 2 for x, _ in bsus], colors="black", linewidth=2,
                      linestyles="dotted", label="baseline, sustained")
    for x, c in zip(xs, cases):
        if c.get(speedup_key) is not None:
            top = max(c[mok_key], c.get(base_key) or 0)
            ax.annotate(f"{c[speedup_key]:.2f}x", (x, top), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    log_ms_axis(ax)
    ax.set_title(title + (": mok vs baseline, speedup above" if has_base else ""))
    ax.legend(fontsize=8)
    ax.margins(y=0.15)


def plot_ablation(ax, rows):
    variants = []  # in order of first appearance, so colours are stable across cases
    for _, chosen, _ in rows:
        variants += [v for v in chosen if v not in variants]
    n = len(variants)
    width = 0.8 / n
    any_fallback = False
    for i, variant in enumerate(variants):
        xs, ms, hatches = [], [], []
        for x, (_, chosen, _) in enumerate(rows):
            if variant in chosen:
                entry, at_default = chosen[variant]
                xs.append(x - 0.4 + width * (i + 0.5))
                ms.append(entry["ms"])
                hatches.append("" if at_default else "//")
                any_fallback |= not at_default
        bars = ax.bar(xs, ms, width, label=variant, color=f"C{i}")
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
    base_label = "baseline"
    for x, (_, _, baseline) in enumerate(rows):
        if baseline is not None:
            ax.hlines(baseline, x - 0.45, x + 0.45, colors="black", linewidth=1.5, label=base_label)
            base_label = None  # one legend entry
    ax.set_xticks(range(len(rows)), [case_label(k) for k, _, _ in rows], fontsize=7)
    log_ms_axis(ax)
    title = "(b) ablation: variants at the default comm SMs / minibatch"
    if any_fallback:
        title += " (hatched: no entry there, fastest shown)"
    ax.set_title(title)
    ax.legend(fontsize=8)


def plot_sweep(ax, lines, xlabel, title):
    for i, (key, points) in enumerate(lines.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i % 10}",
                label=case_label(key, " "))
    log_ms_axis(ax)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def main(argv):
    started = plot_common.start(argv, __doc__, "plot_forward")
    if isinstance(started, int):
        return started
    plt, doc, out_path = started
    in_path = argv[0]

    cases = bf16_cases(doc)
    ablation_rows = default_points(doc)
    comm_lines = sweeps(doc, "comm_sms", "minibatch_tokens")
    mini_lines = sweeps(doc, "minibatch_tokens", "comm_sms")
    # One row per panel; panel (c) gets two axes side by side when both sweeps exist.
    rows = []
    if cases:
        rows.append("cases")
    if any(c.get("mok_bwd_ms") for c in cases):
        rows.append("backward")
    if ablation_rows:
        rows.append("ablation")
    if comm_lines or mini_lines:
        rows.append("sweeps")
    if not rows:
        print(f"plot_forward: {in_path} has no cases and no ablation: nothing to plot",
              file=sys.stderr)
        return 1

    n_bars = max(len(cases), len(ablation_rows))
    fig = plt.figure(figsize=(max(10.0, 1.1 * n_bars), 4.5 * len(rows)))
    grid = fig.add_gridspec(len(rows), 2)
    for r, row in enumerate(rows):
        if row == "cases":
            plot_cases(fig.add_subplot(grid[r, :]), cases)
        elif row == "backward":
            plot_cases(fig.add_subplot(grid[r, :]), cases, "mok_bwd_ms", "baseline_bwd_ms", "bwd_speedup",
                       "(a2) backward per case (mok: the layer's backward kernels)")
        elif row == "ablation":
            plot_ablation(fig.add_subplot(grid[r, :]), ablation_rows)
        else:
            sweeps_here = [(lines, xlabel, title) for lines, xlabel, title in (
                (comm_lines, "comm SMs (minibatch fixed)", f"(c) {SWEEP_VARIANT}: ms vs comm SMs"),
                (mini_lines, "minibatch tokens (comm SMs fixed)",
                 f"(d) {SWEEP_VARIANT}: ms vs minibatch tokens"),
            ) if lines]
            for i, (lines, xlabel, title) in enumerate(sweeps_here):
                span = grid[r, i] if len(sweeps_here) == 2 else grid[r, :]
                plot_sweep(fig.add_subplot(span), lines, xlabel, title)

    fig.suptitle(f"mok layer: {doc.get('gpus', '?')} x {doc.get('device', '?')}, "
                 f"EP {doc.get('ep', '?')}, commit {doc.get('commit', '?')}, {doc.get('date', '?')}")
    return plot_common.finish(fig, out_path, dpi=120)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
