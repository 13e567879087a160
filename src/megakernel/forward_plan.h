// mok — the forward megakernel's work plan: minibatch positions in the ring, the task-ticket
// order of the compute CTAs, and the dependency counters. Shared by the kernel and by the CPU
// tests that prove every tile is issued exactly once and every dependency points to a lower
// ticket (tests/cpu/test_forward_plan.cpp). Keep it free of host- or device-only code. The host plan
// that fills these structures for a layer is forward_setup.h.
//
// Rows and ring. The routed rows [0, total_rows) of this rank (the schedule's table, a multiple of
// 128) are cut into macrobatches of R rows (the ring) aligned to the END: macrobatch q (processing
// order) covers [max(0, total - (q+1)R), total - qR). The last rows are processed first, so the
// first rows (macrobatch 0, possibly short) are the ones left in the ring at the end, for backward.
// Each macrobatch is cut into minibatches of M rows from its start; minibatch i of a macrobatch
// lives at ring rows [i*M, (i+1)*M). Positions g = q*S + i (S = R/M) number the minibatches in
// processing order; since only the last-processed macrobatch can be short, positions are
// contiguous: g in [0, G) with G = ceil(total / M), and only g = G-1 can be a partial minibatch.
// The previous occupant of position g's ring rows is position g - S.
//
// Tickets. Compute CTAs claim tickets 0, 1, 2, ... from one atomic counter. The ticket order is
//   S1 | FC1(0) | S2 | FC1(1) FC2(0) | FC1(2) FC2(1) | ... | FC1(G-1) FC2(G-2) | FC2(G-1) | end
// (S1/S2: the shared expert's FC1/FC2 tiles, which need no communication and so start while the
// first rows land). Inside a block the M tiles are taken in raster groups of group_m: N outer, M
// fastest inside a group, so CTAs working at the same time share weight (B) tiles, and each A tile
// is read by all its N tiles within about one wave. With `pair`, a ticket covers two M tiles
// (m, m+1) with one N tile, for the two CTAs of a cluster (one B tile, multicast, when both rows
// belong to one expert); a short last unit holds one tile. A block of a minibatch always has
// units_per_mb x n_tiles tickets; units past the end of a partial minibatch decode to Skip. A
// task's dependencies are those of each of its tiles.
//
// Dependencies (counter >= target), all pointing to lower tickets or to the comm CTAs:
//   FC1(g) tile:  pulled[g] >= C                       (the comm CTAs landed the rows)
//                 fc2_done[g-S] >= target (g >= S)     (ring h rows free: FC2 of the previous occupant)
//   FC2(g) tile m: fc1_done[m] >= 2*n1                 (this M tile's h complete, both warpgroups)
//                 pushed[g-S] >= C (g >= S)            (ring y rows free: previous occupant pushed)
//   S2 tile m:    s1_done[m] >= 2*n1s
//   comm pull(g): fc1_done[m] >= 2*n1 for every tile m of g-S (ring x rows free)
//   comm push(g): fc2_done[g] >= 2*n2*tiles(g)
// FC1(g) waits on FC2(g-S), which lies in an earlier block only when S >= 2; the layer therefore
// requires a ring of at least two minibatches whenever there is more than one macrobatch.
#pragma once

#include <cstdint>

#include "schedule/schedule_math.h"

namespace mok::mk {

enum TaskKind : int32_t {
  kTaskFc1 = 0,
  kTaskFc2 = 1,
  kTaskShared1 = 2,
  kTaskShared2 = 3,
  kTaskSkip = 4,
  kTaskEnd = 5,
};

// Static (per layer) part of the plan; the number of rows comes from the device at run time.
struct PlanShape {
  int32_t mb_rows = 0;    // M, a multiple of 128
  int32_t ring_rows = 0;  // R, a multiple of M
  int32_t n1 = 0;         // FC1 N tiles (2I / BLOCK_N, rounded up)
  int32_t n2 = 0;         // FC2 N tiles (H / BLOCK_N, rounded up)
  int32_t s_tiles = 0;    // shared expert: M tiles over this rank's tokens (0: no shared expert)
  int32_t n1s = 0;        // shared FC1 N tiles (2Is / BLOCK_N)
  int32_t n2s = 0;        // shared FC2 N tiles (H / BLOCK_N)
  int32_t comm_ctas = 0;  // C
  int32_t group_m = 0;    // tickets per raster group along M inside a block (0: the whole minibatch)
  int32_t pair = 0;       // 1: a ticket is a pair of M tiles (m, m+1) for a 2-CTA cluster
};

MOK_HD int32_t tiles_per_mb(const PlanShape& p) { return p.mb_rows / sched::kBlockM; }
// M tiles of one ticket, and tickets along M of a minibatch / of the shared expert's tokens.
MOK_HD int32_t tiles_per_unit(const PlanShape& p) { return p.pair ? 2 : 1; }
MOK_HD int32_t units_per_mb(const PlanShape& p) { return p.pair ? (tiles_per_mb(p) + 1) / 2 : tiles_per_mb(p); }
MOK_HD int32_t shared_units(const PlanShape& p) { return p.pair ? (p.s_tiles + 1) / 2 : p.s_tiles; }
MOK_HD int32_t ring_slots(const PlanShape& p) { return p.ring_rows / p.mb_rows; }
MOK_HD int32_t num_positions(const PlanShape& p, int32_t total_rows) {
  return static_cast<int32_t>(sched::num_chunks(total_rows, p.mb_rows));
}

// Rows of position g: global routed rows [begin, end) and the ring row of `begin`.
struct MbRows {
  int32_t begin;
  int32_t end;
  int32_t ring;
};
MOK_HD MbRows mb_rows(const PlanShape& p, int32_t total_rows, int32_t g) {
  const int32_t s = ring_slots(p);
  const int32_t q = g / s, i = g - q * s;
  const int32_t macro_end = total_rows - q * p.ring_rows;
  const int32_t macro_begin = macro_end > p.ring_rows ? macro_end - p.ring_rows : 0;
  const int32_t b = macro_begin + i * p.mb_rows;
  const int32_t e = b + p.mb_rows < macro_end ? b + p.mb_rows : macro_end;
  return MbRows{b, e, i * p.mb_rows};
}
MOK_HD int32_t mb_tiles(const MbRows& r) { return (r.end - r.begin) / sched::kBlockM; }

// Targets of the counters (see the header comment).
MOK_HD uint32_t fc1_tile_target(const PlanShape& p) { return 2u * static_cast<uint32_t>(p.n1); }
MOK_HD uint32_t s1_tile_target(const PlanShape& p) { return 2u * static_cast<uint32_t>(p.n1s); }
MOK_HD uint32_t fc2_mb_target(const PlanShape& p, const MbRows& r) {
  return 2u * static_cast<uint32_t>(p.n2) * static_cast<uint32_t>(mb_tiles(r));
}

struct Task {
  int32_t kind;
  int32_t g;       // position (routed tasks)
  int32_t m;       // (first) M tile: global routed tile (routed tasks) or token tile (shared expert)
  int32_t n;       // N tile
  int32_t tiles;   // M tiles m, m+1, ... of the task (1, or 2 for a full pair)
};

// Tickets of the whole order for `positions` minibatches (the layer checks it fits 31 bits).
MOK_HD int64_t num_tickets(const PlanShape& p, int64_t positions) {
  const int64_t upm = units_per_mb(p);
  return int64_t(shared_units(p)) * (p.n1s + p.n2s) + positions * upm * (p.n1 + p.n2);
}

// M unit (within the minibatch) and N tile of index u of a block with n_tiles N tiles.
MOK_HD void block_tile(const PlanShape& p, int32_t n_tiles, int32_t u, int32_t& ml, int32_t& n) {
  const int32_t upm = units_per_mb(p);
  const int32_t gm = p.group_m > 0 && p.group_m < upm ? p.group_m : upm;
  const int32_t grp = u / (gm * n_tiles);
  const int32_t first = grp * gm;
  const int32_t width = gm < upm - first ? gm : upm - first;
  const int32_t r = u - grp * gm * n_tiles;
  ml = first + r % width;
  n = r / width;
}

// Shared-expert task of index t of its block (M units fastest).
MOK_HD Task shared_task(const PlanShape& p, int32_t kind, int32_t t) {
  const int32_t su = shared_units(p), tpu = tiles_per_unit(p);
  const int32_t m = (t % su) * tpu;
  return Task{kind, -1, m, t / su, p.s_tiles - m < tpu ? p.s_tiles - m : tpu};
}

// The task of ticket t (see the header comment for the order). 32-bit arithmetic: this runs in
// the producer thread, which has few registers.
MOK_HD Task decode_ticket(const PlanShape& p, int32_t total_rows, int32_t t) {
  const int32_t G = num_positions(p, total_rows);
  const int32_t upm = units_per_mb(p);
  const int32_t f1 = upm * p.n1, f2 = upm * p.n2;
  const int32_t su = shared_units(p);
  const int32_t s1 = su * p.n1s, s2 = su * p.n2s;
  int32_t kind, g, u;
  if (t < s1) return shared_task(p, kTaskShared1, t);
  t -= s1;
  if (G > 0 && t < f1) {
    kind = kTaskFc1;
    g = 0;
    u = t;
  } else {
    if (G > 0) t -= f1;
    if (t < s2) return shared_task(p, kTaskShared2, t);
    t -= s2;
    if (G == 0) return Task{kTaskEnd, -1, -1, -1, 0};
    const int32_t step = t / (f1 + f2);
    if (step < G - 1) {
      u = t - step * (f1 + f2);
      kind = u < f1 ? kTaskFc1 : kTaskFc2;
      g = u < f1 ? step + 1 : step;
      if (u >= f1) u -= f1;
    } else {
      u = t - (G - 1) * (f1 + f2);
      if (u >= f2) return Task{kTaskEnd, -1, -1, -1, 0};
      kind = kTaskFc2;
      g = G - 1;
    }
  }
  const MbRows r = mb_rows(p, total_rows, g);
  int32_t ml, n;
  block_tile(p, kind == kTaskFc1 ? p.n1 : p.n2, u, ml, n);
  const int32_t first = ml * tiles_per_unit(p), have = mb_tiles(r) - first;
  if (have <= 0) return Task{kTaskSkip, g, -1, -1, 0};
  return Task{kind, g, r.begin / sched::kBlockM + first, n, have < tiles_per_unit(p) ? have : tiles_per_unit(p)};
}

// Counter block layout (uint32 words), zeroed before every launch.
struct CounterLayout {
  int32_t max_positions = 0;  // G for the worst case
  int32_t max_tiles = 0;      // routed M tiles for the worst case
  int32_t s_tiles = 0;
  MOK_HD int32_t ticket() const { return 0; }
  MOK_HD int32_t pulled(int32_t g) const { return 1 + g; }
  MOK_HD int32_t pushed(int32_t g) const { return 1 + max_positions + g; }
  MOK_HD int32_t fc2_done(int32_t g) const { return 1 + 2 * max_positions + g; }
  MOK_HD int32_t fc1_done(int32_t m) const { return 1 + 3 * max_positions + m; }
  MOK_HD int32_t s1_done(int32_t m) const { return 1 + 3 * max_positions + max_tiles + m; }
  MOK_HD int32_t words() const { return 1 + 3 * max_positions + max_tiles + s_tiles; }
};

}  // namespace mok::mk
