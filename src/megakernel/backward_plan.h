// mok — the backward megakernel's work plan (no kernel uses it yet): the task-ticket order of the
// compute CTAs and the dependency counters, for the case the unfused backward supports today,
// where every routed row of the forward is resident (one macrobatch: the ring holds all rows).
// Shared by the future kernel and by the CPU tests that prove every tile is issued exactly once,
// every dependency points to a lower ticket or to the comm CTAs, and the comm/compute interplay
// always finishes (tests/cpu/test_backward_plan.cpp). Free of host- or device-only code.
//
// Per routed M tile m (128 rows of one expert) the backward runs, as Layer::backward does unfused:
//   D2 tiles (m, n < n_d2): d_gu = SwiGLU'(gu, rnd(dy . W_down[e])) over the intermediate columns
//            of N tile n, written over gu (FC2 dgrad fused with the SwiGLU backward);
//   D1 tiles (m, n < n_d1): the d_x rows = rnd(d_gu . [W_gate; W_up][e]) for hidden columns of N tile n;
// and per local expert e, once all of its rows are through D2 (K-grouped over its rows, so an
// expert's weight gradient is one fixed-order fp32 sum: deterministic):
//   WD tiles (e, i < wd_units): dW_down[e] = rnd(dy_e^T h_e)    ([H, I]: H/128 x I/BLOCK_N tiles)
//   W1 tiles (e, i < w1_units): dW_gate/up[e] = rnd(d_gu_e^T x_e)  ([2I, H] packed rows: 2I/128 x H/BLOCK_N tiles)
// The shared expert over this rank's token tiles likewise (SD2, SD1, SWD, SW1), with dy = d_out.
//
// Positions g: the minibatches of forward_plan.h's mb_rows with a ring that holds every row
// (position g = rows [g M, min((g+1) M, total))). Comm CTAs pull the weighted d_out rows of
// position g (dy), and push the d_x rows of g back once its D1 tiles are done.
//
// Tickets. Compute CTAs claim tickets 0, 1, 2, ... from one atomic counter:
//   SD2 | D2(0) | SD1 | D2(1) D1(0) | D2(2) D1(1) | ... | D2(G-1) D1(G-2) | D1(G-1) |
//   SWD SW1 | WD(0) W1(0) | WD(1) W1(1) | ... | WD(E-1) W1(E-1) | end
// (the shared expert needs no communication, so its D2 tiles start while the first rows land;
// an expert's weight gradients follow all D2 tiles, in expert order, so the first experts'
// gradients can start while later D1 tiles still run).
//
// Dependencies (counter >= target), all pointing to lower tickets or to the comm CTAs:
//   D2 tile (m, n):  pulled[g(m)] >= C                 (the comm CTAs landed m's dy rows)
//   D1 tile (m, n):  d2_done[m] >= 2 * n_d2            (m's d_gu complete, both warpgroups)
//   SD1 tile m:      sd2_done[m] >= 2 * n_d2s
//   WD/W1 of e:      d2_done[m] >= 2 * n_d2 for every M tile m of expert e (its dy rows landed,
//                    since its D2 tiles waited for them, and its d_gu is complete)
//   SWD/SW1:         sd2_done[m] >= 2 * n_d2s for every shared token tile m
//   comm push(g):    d1_done[g] >= 2 * n_d1 * tiles(g)
// With every row resident nothing is overwritten during the kernel: no ring-reuse dependencies.
// (A ring smaller than the worst case would overwrite dy rows before the experts' weight
// gradients run; that needs per-macrobatch fp32 partials summed in a fixed order, not planned here.)
#pragma once

#include <cstdint>

#include "megakernel/forward_plan.h"
#include "schedule/schedule_math.h"

namespace mok::mk {

enum BwdTaskKind : int32_t {
  kBwdD2 = 0,
  kBwdD1 = 1,
  kBwdSharedD2 = 2,
  kBwdSharedD1 = 3,
  kBwdWd = 4,   // dW_down of expert e
  kBwdW1 = 5,   // dW_gate and dW_up of expert e (packed rows)
  kBwdSharedWd = 6,
  kBwdSharedW1 = 7,
  kBwdEnd = 8,
};

struct BwdPlanShape {
  int32_t mb_rows = 0;   // M, a multiple of 128
  int32_t experts = 0;   // local experts E
  int32_t n_d2 = 0;      // D2 N tiles (I / BLOCK_N, rounded up)
  int32_t n_d1 = 0;      // D1 N tiles (H / BLOCK_N, rounded up)
  int32_t wd_units = 0;  // WD tiles per expert: ceil(H / 128) * ceil(I / BLOCK_N)
  int32_t w1_units = 0;  // W1 tiles per expert: ceil(2I / 128) * ceil(H / BLOCK_N)
  int32_t s_tiles = 0;   // shared expert: token tiles (0: none)
  int32_t n_d2s = 0;     // shared D2 N tiles (Is / BLOCK_N)
  int32_t swd_units = 0;  // shared WD tiles: ceil(H / 128) * ceil(Is / BLOCK_N)
  int32_t sw1_units = 0;  // shared W1 tiles: ceil(2 Is / 128) * ceil(H / BLOCK_N)
  int32_t comm_ctas = 0;  // C
};

// forward_plan.h's positions with a ring of every row: one macrobatch.
MOK_HD PlanShape bwd_positions(const BwdPlanShape& p, int32_t total_rows) {
  PlanShape f{};
  f.mb_rows = p.mb_rows;
  f.ring_rows = static_cast<int32_t>(sched::round_up(total_rows > p.mb_rows ? total_rows : p.mb_rows, p.mb_rows));
  return f;
}
MOK_HD int32_t bwd_num_positions(const BwdPlanShape& p, int32_t total_rows) {
  return static_cast<int32_t>(sched::num_chunks(total_rows, p.mb_rows));
}
MOK_HD MbRows bwd_mb_rows(const BwdPlanShape& p, int32_t total_rows, int32_t g) {
  return mb_rows(bwd_positions(p, total_rows), total_rows, g);
}
MOK_HD int32_t bwd_tiles_per_mb(const BwdPlanShape& p) { return p.mb_rows / sched::kBlockM; }

// Counter targets (see the header comment).
MOK_HD uint32_t d2_tile_target(const BwdPlanShape& p) { return 2u * static_cast<uint32_t>(p.n_d2); }
MOK_HD uint32_t sd2_tile_target(const BwdPlanShape& p) { return 2u * static_cast<uint32_t>(p.n_d2s); }
MOK_HD uint32_t d1_mb_target(const BwdPlanShape& p, const MbRows& r) {
  return 2u * static_cast<uint32_t>(p.n_d1) * static_cast<uint32_t>(mb_tiles(r));
}

struct BwdTask {
  int32_t kind;
  int32_t g;  // position (D2, D1), -1 otherwise
  int32_t m;  // M tile: routed tile (D2, D1), shared token tile (SD2, SD1), -1 otherwise
  int32_t n;  // N tile (D2, D1, SD2, SD1), or the tile index within the expert's gradient (WD, W1, SWD, SW1)
  int32_t e;  // local expert (WD, W1), -1 otherwise
};

// Tickets of the whole order (no skipped tasks: a block holds exactly its position's tiles).
MOK_HD int64_t bwd_num_tickets(const BwdPlanShape& p, int32_t total_rows) {
  const int64_t routed_tiles = total_rows / sched::kBlockM;
  return int64_t(p.s_tiles) * (p.n_d2s + p.n_d1) + routed_tiles * (p.n_d2 + p.n_d1) +
         (p.s_tiles > 0 ? int64_t(p.swd_units) + p.sw1_units : 0) + int64_t(p.experts) * (p.wd_units + p.w1_units);
}

// The task of ticket t. Inside a block the tiles are taken M fastest (N outer, the forward's
// raster with one group): CTAs working at the same time share weight tiles. 32-bit arithmetic.
MOK_HD BwdTask bwd_decode_ticket(const BwdPlanShape& p, int32_t total_rows, int32_t t) {
  const int32_t G = bwd_num_positions(p, total_rows);
  const int32_t full = bwd_tiles_per_mb(p);
  const int32_t sd2 = p.s_tiles * p.n_d2s, sd1 = p.s_tiles * p.n_d1;
  // Index u of the block of position g with n_tiles N tiles.
  const auto routed = [&](int32_t kind, int32_t g, int32_t u) -> BwdTask {
    const MbRows r = bwd_mb_rows(p, total_rows, g);
    const int32_t tiles = mb_tiles(r);
    return BwdTask{kind, g, r.begin / sched::kBlockM + u % tiles, u / tiles, -1};
  };
  const auto block = [&](int32_t g, int32_t n_tiles) { return mb_tiles(bwd_mb_rows(p, total_rows, g)) * n_tiles; };
  if (t < sd2) return BwdTask{kBwdSharedD2, -1, t % p.s_tiles, t / p.s_tiles, -1};
  t -= sd2;
  if (G > 0) {
    const int32_t b0 = block(0, p.n_d2);
    if (t < b0) return routed(kBwdD2, 0, t);
    t -= b0;
  }
  if (t < sd1) return BwdTask{kBwdSharedD1, -1, t % p.s_tiles, t / p.s_tiles, -1};
  t -= sd1;
  if (G > 1) {
    // Steps g = 1 .. G-2 hold two full positions' blocks: D2(g) then D1(g-1), all the same size.
    const int32_t step = full * (p.n_d2 + p.n_d1), d2 = full * p.n_d2;
    if (t < (G - 2) * step) {
      const int32_t g = 1 + t / step, u = t % step;
      return u < d2 ? routed(kBwdD2, g, u) : routed(kBwdD1, g - 1, u - d2);
    }
    t -= (G - 2) * step;
    const int32_t c2 = block(G - 1, p.n_d2);  // the last position may be short
    if (t < c2) return routed(kBwdD2, G - 1, t);
    t -= c2;
    if (t < full * p.n_d1) return routed(kBwdD1, G - 2, t);
    t -= full * p.n_d1;
  }
  if (G > 0) {
    const int32_t b1 = block(G - 1, p.n_d1);
    if (t < b1) return routed(kBwdD1, G - 1, t);
    t -= b1;
  }
  if (p.s_tiles > 0) {
    if (t < p.swd_units) return BwdTask{kBwdSharedWd, -1, -1, t, -1};
    t -= p.swd_units;
    if (t < p.sw1_units) return BwdTask{kBwdSharedW1, -1, -1, t, -1};
    t -= p.sw1_units;
  }
  const int32_t per_e = p.wd_units + p.w1_units;
  if (per_e > 0 && t < p.experts * per_e) {
    const int32_t e = t / per_e, i = t - e * per_e;
    return i < p.wd_units ? BwdTask{kBwdWd, -1, -1, i, e} : BwdTask{kBwdW1, -1, -1, i - p.wd_units, e};
  }
  return BwdTask{kBwdEnd, -1, -1, -1, -1};
}

// Counter block layout: the forward's (CounterLayout, zeroed before every launch) with its roles
// renamed: per position pulled / pushed / d1_done (the forward's fc2_done: the output a push waits
// for), per routed tile d2_done (fc1_done: what the tile's second GEMM waits for), per shared
// token tile sd2_done (s1_done).
struct BwdCounterLayout : CounterLayout {
  MOK_HD int32_t d1_done(int32_t g) const { return fc2_done(g); }
  MOK_HD int32_t d2_done(int32_t m) const { return fc1_done(m); }
  MOK_HD int32_t sd2_done(int32_t m) const { return s1_done(m); }
};

// ------------------------------------------------------------------------------------------------
// The backward's GEMM program (backward_program.cu): the four GEMMs of the unfused backward's
// window (FC2 dgrad + SwiGLU' = D2, FC1 dgrad = D1, dW_down = WD, dW_gate/up = W1) in one
// persistent kernel, the movement still in its own kernels before and after it. Every tile is the
// tile of the unfused GEMM it replaces (the same plans, BLOCK_N 256), so the bits are the same.
// Tickets: all D2 tiles in the dgrad's raster, then the D1 tiles merged in proportion with the
// weight-gradient tiles (expert by expert, each expert's WD tiles then its W1 tiles, each in the
// wgrad's raster): ticket t of the merged part is a D1 tile when floor((t + 1) d1 / n) >
// floor(t d1 / n) (d1 D1 tiles among n), so compute-bound D1 tiles (K = 2I) and the short-K,
// write-heavy weight-gradient tiles share the GPU throughout. Dependencies: a D1 tile waits for
// its M tile's D2 tiles (d_gu); an expert's WD and W1 tiles for the D2 tiles of the M tiles its
// rows cover (h, written by D2's epilogue, and d_gu). All at lower tickets: no deadlock.
enum BwdGemmKind : int32_t { kGemmD2 = 0, kGemmD1 = 1, kGemmWd = 2, kGemmW1 = 3, kGemmEnd = 4 };

struct BwdGemmShape {
  int32_t m_tiles = 0;       // routed M tiles (D2, D1)
  int32_t n_d2 = 0;          // D2 N tiles (I / BLOCK_N)
  int32_t n_d1 = 0;          // D1 N tiles (H / BLOCK_N)
  int32_t group_m = 8;       // raster groups (the plans' Options::group_m)
  int32_t experts = 0;       // experts whose weight gradients the program runs
  int32_t wd_m = 0, wd_n = 0;  // WD tiles of an expert: ceil(H / 128) x ceil(I / BLOCK_N)
  int32_t w1_m = 0, w1_n = 0;  // W1 tiles of an expert: ceil(2I / 128) x ceil(H / BLOCK_N)
  // 1: the D1 tiles merged with the weight-gradient tiles (above); 0: phased, all D1 tiles then
  // all weight-gradient tiles (the unfused kernels' order in one kernel); 2: phased, with only the
  // D2 and D1 tickets claimed from the counter and the weight-gradient tiles dealt out statically
  // (CTA c of G takes weight-gradient tiles c, c + G, ... once the counter's tickets are gone: no
  // atomic per short tile, as the standalone wgrad kernel's schedule).
  int32_t merge = 0;
};

struct BwdGemmTask {
  int32_t kind;
  int32_t m, n;  // D2, D1: routed M tile and N tile; WD, W1: output tile of the expert
  int32_t e;     // WD, W1: the expert's index among the scheduled ones; -1 otherwise
};

MOK_HD int64_t bwd_gemm_d1_tickets(const BwdGemmShape& s) { return int64_t(s.m_tiles) * s.n_d1; }
MOK_HD int64_t bwd_gemm_w_tickets(const BwdGemmShape& s) {
  return int64_t(s.experts) * (int64_t(s.wd_m) * s.wd_n + int64_t(s.w1_m) * s.w1_n);
}
MOK_HD int64_t bwd_gemm_tickets(const BwdGemmShape& s) {
  return int64_t(s.m_tiles) * s.n_d2 + bwd_gemm_d1_tickets(s) + bwd_gemm_w_tickets(s);
}

// The task of ticket t (End from bwd_gemm_tickets on).
MOK_HD BwdGemmTask bwd_gemm_decode(const BwdGemmShape& s, int64_t t) {
  const int64_t d2 = int64_t(s.m_tiles) * s.n_d2;
  if (t < d2) {
    const sched::TileMN r = sched::tile_raster(int32_t(t), s.m_tiles, s.n_d2, s.group_m);
    return BwdGemmTask{kGemmD2, r.m, r.n, -1};
  }
  t -= d2;
  const int64_t d1 = bwd_gemm_d1_tickets(s), n = d1 + bwd_gemm_w_tickets(s);
  if (t >= n) return BwdGemmTask{kGemmEnd, -1, -1, -1};
  const bool merged = s.merge == 1;
  const int64_t before = merged ? t * d1 / n : (t < d1 ? t : d1);  // D1 tiles among the first t tickets
  if (merged ? (t + 1) * d1 / n > before : t < d1) {
    const sched::TileMN r = sched::tile_raster(int32_t(before), s.m_tiles, s.n_d1, s.group_m);
    return BwdGemmTask{kGemmD1, r.m, r.n, -1};
  }
  const int32_t w = int32_t(t - before);
  const int32_t wd = s.wd_m * s.wd_n, per_e = wd + s.w1_m * s.w1_n;
  const int32_t e = w / per_e, i = w - e * per_e;
  const sched::TileMN r = i < wd ? sched::tile_raster(i, s.wd_m, s.wd_n, s.group_m)
                                 : sched::tile_raster(i - wd, s.w1_m, s.w1_n, s.group_m);
  return BwdGemmTask{i < wd ? kGemmWd : kGemmW1, r.m, r.n, e};
}

// The tickets claimed from the counter: all of them, or with static weight gradients (merge 2)
// the D2 and D1 ones; weight-gradient tile w (0-based) is then ticket dynamic + w.
MOK_HD int64_t bwd_gemm_dynamic_tickets(const BwdGemmShape& s) {
  return s.merge == 2 ? int64_t(s.m_tiles) * s.n_d2 + bwd_gemm_d1_tickets(s) : bwd_gemm_tickets(s);
}

// The M tiles [first, end) that an expert's rows [begin, begin + rows) of the window cover (its
// weight-gradient tiles wait for their D2 tiles).
MOK_HD sched::TileMN bwd_gemm_expert_tiles(int32_t begin, int32_t rows) {
  return rows > 0 ? sched::TileMN{begin / sched::kBlockM, (begin + rows + sched::kBlockM - 1) / sched::kBlockM}
                  : sched::TileMN{0, 0};
}

}  // namespace mok::mk
