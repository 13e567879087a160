#!/usr/bin/env python3
"""Plot of the grouped-GEMM benchmark (bench/results/gemm-h200x1.json).

  python3 bench/gemm/plot_gemm.py GEMM_JSON OUT_PNG

One panel per row count per expert (128, 512, 2048): per case, mok's and torch._grouped_mm's
TF/s side by side, with
  * the issue's bar for mok (1.25 x torch at 128 rows, 1.05 x elsewhere) as a red tick,
  * the memory roofline (bench/gemm/roofline.py: weights + activations + output once at the copy
    rate measured in the run, or 4.3 TB/s) as a black tick where it is below the peak,
  * the dense cuBLAS peak of the run as a dashed line,
  * where the run has it, torch doing the same work as mok's fused forms (its GEMM plus the SwiGLU
    or the SwiGLU backward in torch ops) as a black dash on torch's bar.
Forward forms (fc1, fc2) first, then the backward forms (dgrad, wgrad) of the same row count.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import plot_common  # noqa: E402
from roofline import DEFAULT_COPY_TBPS, roofline_tflops  # noqa: E402

FORM_ORDER = {"fc1": 0, "fc1_fp8": 0, "fc2": 1, "fc2_fp8": 1, "dgrad": 2, "dgrad_fc1": 2, "dgrad_swiglu": 3, "wgrad": 4}


def bar_factor(rows_per_expert):
    return 1.25 if rows_per_expert == 128 else 1.05


def case_flops(c):
    if c.get("flops"):
        return c["flops"]
    if c.get("mok_ms") and c.get("mok_tflops"):
        return c["mok_tflops"] * c["mok_ms"] * 1e9
    return None


def short_name(c):
    name = c["name"].replace("qwen3-235b-a22b", "q235b").replace("qwen3-30b-a3b", "q30b")
    return f"{name}\n{c['routing']}"


def panels(doc):
    """[(rows_per_expert, [case, ...])] in ascending row count, cases ordered by form, name, routing."""
    by_rows = {}
    for c in doc.get("cases", []):
        if c.get("mok_tflops") is None:
            continue
        by_rows.setdefault(c["rows_per_expert"], []).append(c)
    out = []
    for rows in sorted(by_rows):
        cs = sorted(by_rows[rows], key=lambda c: (FORM_ORDER.get(c["form"], 9), c["name"], c["routing"]))
        out.append((rows, cs))
    return out


def plot_panel(ax, rows, cases, peak, copy):
    xs = range(len(cases))
    width = 0.4
    mok = [c["mok_tflops"] for c in cases]
    tor = [c.get("torch_grouped_mm_tflops") for c in cases]
    ax.bar([x - width / 2 for x in xs], mok, width, label="mok", color="C0")
    ax.bar([x + width / 2 for x in xs], [t or 0 for t in tor], width, label="torch._grouped_mm", color="C7")
    # torch doing the same work as mok's fused forms: its GEMM plus the SwiGLU (fc1) or the SwiGLU
    # backward (dgrad_swiglu) in torch ops.
    same = [(x, c.get("torch_fc1_swiglu_tflops") or c.get("torch_dgrad_swiglu_tflops")) for x, c in zip(xs, cases)]
    same = [(x, t) for x, t in same if t]
    if same:
        ax.scatter([x + width / 2 for x, _ in same], [t for _, t in same], marker="_", s=120, color="black",
                   zorder=3, label="torch + SwiGLU (fwd / bwd) in torch ops")
    # The bar applies to the forward forms only.
    bars = [(x, bar_factor(rows) * t) for x, t, c in zip(xs, tor, cases) if t and c["form"] in ("fc1", "fc2")]
    if bars:
        ax.hlines([b for _, b in bars], [x - width for x, _ in bars], [x for x, _ in bars], colors="red",
                  linewidth=2, label=f"bar: {bar_factor(rows):.2f} x torch")
    roofs = []
    for x, c in zip(xs, cases):
        r = roofline_tflops(c, case_flops(c), peak, copy)
        if r is not None and peak and r < peak:
            roofs.append((x, r))
    if roofs:
        ax.hlines([r for _, r in roofs], [x - width for x, _ in roofs], [x + width for x, _ in roofs],
                  colors="black", linewidth=2, label=f"memory roofline ({copy:g} TB/s)")
    if peak:
        ax.axhline(peak, color="black", linestyle="--", linewidth=1, label=f"cuBLAS dense peak {peak:.0f}")
    for x, c in zip(xs, cases):
        if c.get("speedup"):
            ax.annotate(f"{c['speedup']:.2f}x", (x, max(mok[x], tor[x] or 0)), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
    first_bwd = next((x for x, c in zip(xs, cases) if c["form"] not in ("fc1", "fc2")), None)
    if first_bwd:
        ax.axvline(first_bwd - 0.5, color="grey", linewidth=1)
        ax.annotate("backward forms ->", (first_bwd - 0.4, 0.02), xycoords=("data", "axes fraction"), fontsize=7)
    top = max([peak or 0] + mok + [t or 0 for t in tor])
    ax.set_ylim(0, 1.3 * top)  # room above the peak line for the legend
    ax.set_xticks(list(xs), [short_name(c) for c in cases], fontsize=6, rotation=90)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{rows} rows per expert (speedup over torch above the bars)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncol=5)


def main(argv):
    started = plot_common.start(argv, __doc__, "plot_gemm")
    if isinstance(started, int):
        return started
    plt, doc, out_path = started
    in_path = argv[0]
    groups = panels(doc)
    if not groups:
        print(f"plot_gemm: {in_path} has no cases with mok_tflops: nothing to plot", file=sys.stderr)
        return 1
    peak = doc.get("peak_bf16_tflops")
    copy = doc.get("copy_tbps") or DEFAULT_COPY_TBPS
    width = max(10.0, 0.45 * max(len(cs) for _, cs in groups))
    fig, axes = plt.subplots(len(groups), 1, figsize=(width, 4.8 * len(groups)), squeeze=False)
    for ax, (rows, cs) in zip(axes[:, 0], groups):
        plot_panel(ax, rows, cs, peak, copy)
    fig.suptitle(f"mok grouped GEMM vs torch._grouped_mm: {doc.get('device', '?')}, commit "
                 f"{str(doc.get('commit', '?'))[:10]}, {doc.get('date', '?')}")
    return plot_common.finish(fig, out_path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
