#!/usr/bin/env python3
"""Self-test of bench/gemm/raster_model.py: both orders run every tile once, the expert-split order
keeps each expert's tiles in the range of its M tiles, and it reads no weight tile more often."""
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raster_model import expert_tile_raster, tile_raster, weight_reads  # noqa: E402


def layout(seed, experts=30):
    rng = random.Random(seed)
    te = [e for e in range(experts) for _ in range(rng.randrange(0, 5))]
    return te + [-1] * rng.randrange(0, 4)


class RasterModel(unittest.TestCase):
    def test_every_tile_once(self):
        for seed in range(8):
            te = layout(seed)
            for n_tiles in (1, 5, 28):
                for group_m in (1, 3, 8):
                    plain = {tile_raster(r, len(te), n_tiles, group_m) for r in range(len(te) * n_tiles)}
                    split = [expert_tile_raster(r, len(te), n_tiles, group_m, te) for r in range(len(te) * n_tiles)]
                    self.assertEqual(len(plain), len(te) * n_tiles)
                    self.assertEqual(len(set(split)), len(te) * n_tiles)
                    for r, (m, _) in enumerate(split):  # the expert of the M tiles r's range spans
                        self.assertEqual(te[m], te[r // n_tiles])

    def test_split_groups_read_no_more(self):
        for seed in range(4):
            te = layout(seed, experts=80)
            for windows in (1, 3):
                plain = weight_reads(te, windows, 28, 8, 132, "tile_raster")
                split = weight_reads(te, windows, 28, 8, 132, "expert_tile_raster")
                self.assertLessEqual(split, plain)
                self.assertGreaterEqual(split, len(set(e for e in te if e >= 0)) * 28)  # each once at least

    def test_one_expert_is_tile_raster(self):
        te = [3] * 21
        for r in range(21 * 7):
            self.assertEqual(expert_tile_raster(r, 21, 7, 8, te), tile_raster(r, 21, 7, 8))


if __name__ == "__main__":
    unittest.main()
