"""Shared start and end of the result plots (bench/plot_forward.py, bench/gemm/plot_gemm.py)."""
import json
import sys


def start(argv, usage, tool):
    """Checks `IN_JSON OUT_PNG` arguments and loads matplotlib (file output only) and the JSON.
    Returns (plt, doc, out_path), or an exit status (2) after printing why."""
    if len(argv) != 2:
        print(usage.strip(), file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")  # file output only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{tool}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    in_path, out_path = argv
    with open(in_path) as f:
        doc = json.load(f)
    return plt, doc, out_path


def finish(fig, out_path, dpi):
    fig.tight_layout()
    fig.savefig(out_path, dpi=dpi)
    print(f"wrote {out_path}")
    return 0
