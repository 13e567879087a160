// mok — routing-schedule index math shared by the CPU reference and the GPU schedule kernels.
//
// This header is the single definition of where a routed token lands on its expert's rank. The
// CPU twin (schedule_cpu.cpp) and the GPU builder both call these functions, so their tables are
// bitwise identical. Keep it free of host-only or device-only code.
//
// Layout of one destination rank's routed buffer ("receiver-side table"):
//   * segments per local expert, in increasing local expert index;
//   * each segment padded to a multiple of kBlockM rows, so every GEMM M-tile has one expert;
//   * inside a segment, source ranks are interleaved round-robin: ordinal 0 of every source rank
//     (in rank order), then ordinal 1 of every rank that still has one, and so on. Pulls of
//     consecutive rows therefore spread across all NVLink peers;
//   * the n-th route of source rank r to expert e is its n-th slot s = t*k + j in increasing slot
//     order among that rank's routes to e;
//   * padding rows hold src_rank = src_slot = -1.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__ __forceinline__
#else
#define MOK_HD inline
#endif

namespace mok::sched {

// GEMM M-tile height; every expert segment is padded to a multiple of it.
inline constexpr int kBlockM = 128;
// Largest EP group the kernels are written for (one NVLink domain of HGX H100/H200 is 8; the
// schedule math itself has no such limit, the bound keeps per-expert count arrays on chip).
inline constexpr int kMaxWorldSize = 64;
// Largest top-k accepted.
inline constexpr int kMaxTopK = 32;

MOK_HD int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
MOK_HD int64_t ceil_div(int64_t n, int64_t m) { return (n + m - 1) / m; }
MOK_HD int64_t pad_rows(int64_t n) { return round_up(n, kBlockM); }

// Rows a rank can ever receive: all `routes` of all ranks land on it, and each non-empty expert
// (at most min(routes, e_loc) of them) wastes up to kBlockM - 1 padding rows. A real table is a
// whole number of tiles, so the bound rounds down to one.
MOK_HD int64_t worst_case_rows(int64_t routes, int64_t e_loc) {
  const int64_t busy = routes < e_loc ? routes : e_loc;
  return (routes + busy * (kBlockM - 1)) / kBlockM * kBlockM;
}

// The GPU schedule builder's device buffers, in int32 elements (schedule_gpu.cu allocates them,
// the memory planner counts them): per-chunk expert histograms (chunks of kBuilderChunk routes of
// one source rank), counts per (expert, rank), rows and offsets per expert, the source rank and
// slot of every routed row of the worst case, the expert of every M tile.
inline constexpr int kBuilderChunk = 2048;
struct BuilderSizes {
  int64_t chunk_hist, counts, expert_rows, expert_offset, src_rank, src_slot, tile_expert;
  int64_t total() const { return chunk_hist + counts + expert_rows + expert_offset + src_rank + src_slot + tile_expert; }
};
inline BuilderSizes builder_sizes(int64_t total_chunks, int64_t e_loc, int world, int64_t capacity_rows) {
  return {total_chunks * e_loc, e_loc * world, e_loc, e_loc + 1, capacity_rows, capacity_rows,
          capacity_rows / kBlockM};
}

// Owner rank and local index of a global expert id.
MOK_HD int owner_rank(int64_t expert, int64_t e_loc) { return static_cast<int>(expert / e_loc); }
MOK_HD int64_t local_expert(int64_t expert, int64_t e_loc) { return expert % e_loc; }

// Row, relative to the start of the expert's segment, of the n-th route (0-based, slot order)
// from source rank r, given every source rank's route count to this expert.
//   row = sum_q min(count[q], n) + #{q < r : count[q] > n}
// i.e. all earlier "rounds" (each rank contributes min(count, n) rows to rounds 0..n-1) plus the
// ranks before r that still take part in round n.
MOK_HD int64_t interleaved_row(const int32_t* counts, int world, int r, int64_t n) {
  int64_t row = 0;
  for (int q = 0; q < world; ++q) {
    const int64_t c = counts[q];
    row += c < n ? c : n;
    if (q < r && c > n) ++row;
  }
  return row;
}

// Minibatches split the routed rows into equal chunks (a multiple of kBlockM rows, so no M-tile
// straddles two minibatches); the last one may be shorter.
MOK_HD int64_t num_chunks(int64_t rows, int64_t chunk) { return rows == 0 ? 0 : ceil_div(rows, chunk); }
MOK_HD int64_t chunk_begin(int64_t index, int64_t chunk) { return index * chunk; }
MOK_HD int64_t chunk_end(int64_t index, int64_t chunk, int64_t rows) {
  const int64_t e = (index + 1) * chunk;
  return e < rows ? e : rows;
}

// The backward over windows of the routed layout (a ring smaller than the worst case, notes/memory.md):
// window [lo, hi) of rows (multiples of kBlockM), an expert's token rows [begin, begin + rows).
// Its part in the window, with `begin` relative to the window's first row (the window's buffers
// hold its rows only); rows = 0 when the expert has none there.
struct WindowPart {
  int32_t begin, rows;
};
MOK_HD WindowPart window_part(int64_t begin, int64_t rows, int64_t lo, int64_t hi) {
  const int64_t s = begin > lo ? begin : lo, e = begin + rows < hi ? begin + rows : hi;
  return e > s ? WindowPart{int32_t(s - lo), int32_t(e - s)} : WindowPart{0, 0};
}
// Raster of a grid of num_m x n_tiles output tiles (the grouped GEMMs' and the backward program's
// tile order): groups of group_m M tiles, N outer and M inner inside a group, so the CTAs that run
// at the same time share B tiles (same expert) and A tiles. 32-bit arithmetic.
struct TileMN {
  int32_t m, n;
};
MOK_HD TileMN tile_raster(int32_t r, int32_t num_m, int32_t n_tiles, int32_t group_m) {
  const int32_t per_group = group_m * n_tiles;
  const int32_t g = r / per_group;
  const int32_t in = r - g * per_group;
  const int32_t first = g * group_m;
  const int32_t size = num_m - first < group_m ? num_m - first : group_m;
  return TileMN{first + in % size, in / size};
}
// tile_raster with groups that never hold two experts: each group_m group split where the expert
// changes (tile_expert[m]: the expert of M tile m, each expert's tiles contiguous; -1 tiles are
// their own run). Why: inside a group the CTAs running at once read an expert's weight tile
// together, once from DRAM; an expert whose tiles straddle two plain groups is read again a whole
// group later. At DeepSeek-V3 EP 1 (256 +- 16 rows per expert: 2 or 3 tiles) that is a third of
// the experts, and FC1's dgrad over the backward's 12 windows read 20 GB where the weights are
// 15 (ncu, one H100, bench/results/backward-kernels-ncu-h100x1.json); by a model of 132 tiles in
// flight (bench/gemm/raster_model.py), 17.3 GB of weight tiles with plain groups of 8, 16.0 split.
// The groups are contiguous ranges of M tiles, so M tile r / n_tiles lies in r's group.
MOK_HD TileMN expert_tile_raster(int32_t r, int32_t num_m, int32_t n_tiles, int32_t group_m,
                                 const int32_t* tile_expert) {
  const int32_t mp = r / n_tiles;
  const int32_t b = mp - mp % group_m;
  const int32_t end = num_m - b < group_m ? num_m : b + group_m;
  const int32_t e = tile_expert[mp];
  int32_t lo = mp, hi = mp + 1;
  while (lo > b && tile_expert[lo - 1] == e) --lo;
  while (hi < end && tile_expert[hi] == e) ++hi;
  const int32_t in = r - lo * n_tiles, size = hi - lo;
  return TileMN{lo + in % size, in / size};
}
// Division by a divisor fixed for a kernel's lifetime, for the per-tile decode of persistent
// kernels: 32-bit integer division is ~20 dependent instructions on the GPU (reciprocal, two
// multiply-highs, corrections), and a weight-gradient tile over few rows pays three of them between
// its epilogue and its first MMA (notes/gemm.md, "Short weight-gradient tiles"). Here: the float
// reciprocal's estimate, corrected once. Exact for 0 <= n < 2^22 and 1 <= d < 2^22: n, d and q d are
// exact in float, the reciprocal and the product are each correctly rounded (no fast math), so the
// estimate is within n/d (2^-23 + 2^-48) < 0.5 of n/d; truncating a non-negative value floors it,
// so the quotient is off by at most one and r = n - q d tells which way (CPU test: FastDiv).
struct Divisor {
  int32_t d;
  float inv;
};
MOK_HD Divisor divisor(int32_t d) { return Divisor{d, 1.0f / float(d)}; }
MOK_HD int32_t div_by(int32_t n, Divisor v) {
  const int32_t q = int32_t(float(n) * v.inv);
  const int32_t r = n - q * v.d;
  return q + (r >= v.d ? 1 : 0) - (r < 0 ? 1 : 0);
}

// tile_raster with its divisors made once (RasterPlan): the same (m, n) for every
// 0 <= r < num_m * n_tiles < 2^22 (CPU test: FastDiv.RasterPlanIsTileRaster). group_m is clamped
// to num_m (one group either way), so that every divisor is at most num_m * n_tiles.
struct RasterPlan {
  int32_t group_m, last_first;  // last_first: the first M tile of the last (short) group
  Divisor per_group, size, last_size;
};
MOK_HD RasterPlan raster_plan(int32_t num_m, int32_t n_tiles, int32_t group_m) {
  const int32_t g = group_m < num_m ? group_m : num_m;
  const int32_t last_first = (num_m - 1) / g * g;
  return RasterPlan{g, last_first, divisor(g * n_tiles), divisor(g), divisor(num_m - last_first)};
}
MOK_HD TileMN tile_raster(int32_t r, const RasterPlan& p) {
  const int32_t g = div_by(r, p.per_group);
  const int32_t in = r - g * p.per_group.d;
  const int32_t first = g * p.group_m;
  const Divisor size = first == p.last_first ? p.last_size : p.size;
  const int32_t n = div_by(in, size);
  return TileMN{first + in - n * size.d, n};
}

// Whether the expert's token rows go on past row `cut` (it has rows on both sides): its weight
// gradient's fp32 sums are carried from the window ending at `cut` into the next one.
MOK_HD bool rows_cross(int64_t begin, int64_t rows, int64_t cut) { return begin < cut && cut < begin + rows; }
// Whether window [lo, hi) runs the expert's weight-gradient tiles: it has rows there, or it has no
// rows at all and its (empty) place in the layout is there (the last window also takes those past
// its end: a full layout has no window at their offset), so that each expert's gradient is
// written by exactly one window's calls and a window's experts are one contiguous range.
MOK_HD bool window_owns(int64_t begin, int64_t rows, int64_t lo, int64_t hi, bool last) {
  if (rows > 0) return window_part(begin, rows, lo, hi).rows > 0;
  return begin >= lo && (begin < hi || last);
}

// The end of the window that starts at row lo of a layout of `total` rows, walked with a ring of
// `ring` rows (the layer's backward over windows): a ring's worth, cut at the activation budget's
// end `saved` when that falls inside (both multiples of kBlockM: windows of whole tiles).
MOK_HD int64_t window_end(int64_t lo, int64_t ring, int64_t total, int64_t saved) {
  const int64_t hi = lo + ring < total ? lo + ring : total;
  return lo < saved && saved < hi ? saved : hi;
}

// Held rows instead of a carry (the bf16 backward over windows): an expert cut by a window's end
// whose rows in that window fit `rows` (and which started there) is not run by that window at
// all; its rows there — the weight gradients' operands — are copied aside and the next window
// runs the expert over them and its own rows, in that K order (WgradArgs::hold_*): the resident
// bits without writing and reading one expert's fp32 sums (117 MB for DeepSeek-V3's dW_gate/up)
// per cut, and without the cut expert's tiles twice at half K. Only where the next window also
// starts before `end` (the saved gate/up rows' end: those windows read d_gu in place and keep no
// gate/up rows of their own, so the held rows can live in that scratch). rows = 0: no holding.
struct WindowHold {
  int64_t rows = 0;     // most rows held (a multiple of kBlockM)
  int64_t prev_lo = 0;  // the previous window's first row
  int64_t end = 0;      // a cut at or past it is carried
};
MOK_HD bool held_over(int64_t begin, int64_t rows, int64_t lo, int64_t cut, int64_t hold_rows, int64_t end) {
  return rows_cross(begin, rows, cut) && begin >= lo && cut - begin <= hold_rows && cut < end;
}

// What window [lo, hi)'s weight gradients exchange with the windows around it: the experts whose
// fp32 sums come from / go to the carry buffers (-1 = none), the experts it runs ({first, count}:
// window_owns, less an expert held over to the next window), the expert the previous window held
// over (its K then starts held_in_rows rows before the window) and the one this window holds over
// (its rows from held_out_at, window-relative). offset / rows: the experts' layout (one thread).
struct WindowEnds {
  // (in this order the int32 words after a window's parts: gpu::window_parts, kWindowEndWords)
  int32_t carry_in = -1, carry_out = -1, first = 0, owned = 0;
  int32_t held_in = -1, held_in_rows = 0, held_out = -1, held_out_rows = 0, held_out_at = 0;
};
inline constexpr int64_t kWindowEndWords = 7;
// window_ends from what a walk over the experts found: the (last) expert whose rows cross lo and
// the one crossing hi (-1: none), the first and last expert the window owns (-1: none). A GPU
// finds them with one thread per expert (gpu::window_parts); window_ends below walks in order.
MOK_HD WindowEnds window_ends_of(const int32_t* offset, const int32_t* rows, int32_t cross_lo, int32_t cross_hi,
                                 int32_t first, int32_t last_owned, int64_t lo, int64_t hi, const WindowHold& hold) {
  WindowEnds w;
  if (cross_lo >= 0) {
    const int64_t b = offset[cross_lo], r = rows[cross_lo];
    if (held_over(b, r, hold.prev_lo, lo, hold.rows, hold.end)) {
      w.held_in = cross_lo;
      w.held_in_rows = int32_t(lo - b);
    } else {
      w.carry_in = cross_lo;
    }
  }
  if (cross_hi >= 0) {
    const int64_t b = offset[cross_hi], r = rows[cross_hi];
    if (held_over(b, r, lo, hi, hold.rows, hold.end)) {
      w.held_out = cross_hi;
      w.held_out_rows = int32_t(hi - b);
      w.held_out_at = int32_t(b - lo);
    } else {
      w.carry_out = cross_hi;
    }
  }
  w.first = first < 0 ? 0 : first;
  w.owned = first < 0 ? 0 : last_owned - first + 1;
  if (w.held_out >= 0) w.owned -= 1;  // (the window's last owned expert: nothing after it starts before hi)
  return w;
}

MOK_HD WindowEnds window_ends(const int32_t* offset, const int32_t* rows, int32_t experts, int64_t lo, int64_t hi,
                              bool last, const WindowHold& hold) {
  int32_t cross_lo = -1, cross_hi = -1, first = -1, last_owned = -1;
  for (int32_t e = 0; e < experts; ++e) {
    const int64_t b = offset[e], r = rows[e];
    if (rows_cross(b, r, lo)) cross_lo = e;
    if (rows_cross(b, r, hi)) cross_hi = e;
    if (window_owns(b, r, lo, hi, last)) {
      if (first < 0) first = e;
      last_owned = e;
    }
  }
  return window_ends_of(offset, rows, cross_lo, cross_hi, first, last_owned, lo, hi, hold);
}

}  // namespace mok::sched
