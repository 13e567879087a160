#!/usr/bin/env python3
"""How often an M-grouped GEMM reads each expert's weight tiles from DRAM, by tile order.

A model, not a measurement: the persistent GEMM runs its tiles in order, `--sms` at a time
(lockstep waves, all tiles alike); a weight tile (expert, N column) is read from DRAM once per wave
that runs it (the CTAs of one wave read it together, through L2), so an expert whose tiles of one
column fall in two waves is read twice. Orders: schedule_math.h's tile_raster (groups of group_m M
tiles, N outer, M inner) and expert_tile_raster (the same groups split where the expert changes).
Rows per expert: uniform top-k routing (a multinomial draw), each expert padded to 128-row tiles;
the backward runs over `--windows` equal slices of the tiles (layer_backward_windows.cu).

  python3 bench/gemm/raster_model.py [--experts 256 --tokens 8192 --topk 8 --hidden 7168
      --inter 2048 --windows 12 --group-m 8 --sms 132 --seed 1]

Prints, per order, the weight tiles read and their bytes for FC1's dgrad (K = 2I, N = H: tiles of
2I x 256 of W_gate/W_up) and FC2's (K = H, N = I: tiles of H x 256 of W_down).
"""
import argparse
import random


def tile_raster(r, num_m, n_tiles, group_m):
    per = group_m * n_tiles
    g, inn = divmod(r, per)
    first = g * group_m
    size = min(group_m, num_m - first)
    return first + inn % size, inn // size


def expert_tile_raster(r, num_m, n_tiles, group_m, tile_expert):
    mp = r // n_tiles
    b = mp - mp % group_m
    end = min(b + group_m, num_m)
    e = tile_expert[mp]
    lo, hi = mp, mp + 1
    while lo > b and tile_expert[lo - 1] == e:
        lo -= 1
    while hi < end and tile_expert[hi] == e:
        hi += 1
    inn = r - lo * n_tiles
    return lo + inn % (hi - lo), inn // (hi - lo)


def weight_reads(tile_expert, windows, n_tiles, group_m, sms, order):
    """Weight tiles read from DRAM over the windows' calls (expert, column, wave) triples."""
    reads = 0
    cuts = [round(i * len(tile_expert) / windows) for i in range(windows + 1)]
    for lo, hi in zip(cuts, cuts[1:]):
        te = tile_expert[lo:hi]
        seen = set()
        for r in range(len(te) * n_tiles):
            m, n = (expert_tile_raster(r, len(te), n_tiles, group_m, te) if order == "expert_tile_raster"
                    else tile_raster(r, len(te), n_tiles, group_m))
            if te[m] >= 0:
                seen.add((r // sms, te[m], n))
        reads += len(seen)
    return reads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("experts", 256), ("tokens", 8192), ("topk", 8), ("hidden", 7168), ("inter", 2048),
                          ("windows", 12), ("group-m", 8), ("sms", 132), ("seed", 1)):
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = [0] * a.experts
    for _ in range(a.tokens * a.topk):
        rows[rng.randrange(a.experts)] += 1
    tile_expert = [e for e in range(a.experts) for _ in range((rows[e] + 127) // 128)]
    print(f"{a.experts} experts, {a.tokens * a.topk} routed rows ({min(rows)}-{max(rows)} per expert), "
          f"{len(tile_expert)} M tiles, {a.windows} windows, groups of {a.group_m}, {a.sms} tiles at once")
    for what, n, k in (("FC1 dgrad (W_gate/W_up)", a.hidden // 256, 2 * a.inter),
                       ("FC2 dgrad (W_down)", a.inter // 256, a.hidden)):
        ideal = a.experts * n
        for order in ("tile_raster", "expert_tile_raster"):
            r = weight_reads(tile_expert, a.windows, n, a.group_m, a.sms, order)
            print(f"  {what:24s} {order:19s} {r:6d} weight tiles = {r / ideal:.3f}x each once, "
                  f"{r * k * 256 * 2 / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
