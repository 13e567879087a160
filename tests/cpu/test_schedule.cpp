// The schedule's index math (schedule_math.h) and its CPU builder.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "mok/schedule.hpp"
#include "test_names.h"
#include "mok/workload.hpp"
#include "schedule/schedule_math.h"

namespace sched = mok::sched;

TEST(ScheduleMath, PaddingAndWorstCase) {
  EXPECT_EQ(sched::pad_rows(0), 0);
  EXPECT_EQ(sched::pad_rows(1), 128);
  EXPECT_EQ(sched::pad_rows(128), 128);
  EXPECT_EQ(sched::pad_rows(129), 256);
  // 10 routes over 3 experts: at most 3 segments of 128 rows (e.g. 8 + 1 + 1).
  EXPECT_EQ(sched::worst_case_rows(10, 3), 384);
  EXPECT_EQ(sched::worst_case_rows(0, 5), 0);
  EXPECT_EQ(sched::worst_case_rows(2, 5), 256);      // two single-token experts
  EXPECT_EQ(sched::worst_case_rows(1000, 2), 1152);  // 873 + 127 -> 1024 + 128
  // Brute force over all splits of 300 routes into 3 experts: the bound is reached, never beaten.
  int64_t best = 0;
  for (int64_t a = 0; a <= 300; ++a)
    for (int64_t b = 0; a + b <= 300; ++b)
      best = std::max(best, sched::pad_rows(a) + sched::pad_rows(b) + sched::pad_rows(300 - a - b));
  EXPECT_EQ(best, sched::worst_case_rows(300, 3));
}

// Windows of the routed layout (the backward over a ring smaller than the worst case): every
// token row of an expert is in exactly one window's part, parts are window-relative, and the
// experts carried across a cut are those with rows on both sides of it (at most one per cut, the
// experts' rows being contiguous and disjoint).
TEST(ScheduleMath, WindowPartsCoverEveryRowOnceAndCarryAcrossCuts) {
  // Experts' [begin, rows) in a padded layout: 300, 0, 700, 129, 64 token rows.
  const std::vector<std::pair<int64_t, int64_t>> experts = {{0, 300}, {384, 0}, {384, 700}, {1152, 129}, {1408, 64}};
  const int64_t total = 1536;
  for (const int64_t window : {int64_t(128), int64_t(256), int64_t(384), int64_t(1024), int64_t(2048)}) {
    std::vector<int64_t> covered(static_cast<size_t>(total), 0);
    for (int64_t lo = 0; lo < total; lo += window) {
      const int64_t hi = lo + window;
      int carried_out = 0;
      for (const auto& [begin, rows] : experts) {
        const mok::sched::WindowPart p = mok::sched::window_part(begin, rows, lo, hi);
        EXPECT_GE(p.rows, 0);
        EXPECT_LE(p.begin + p.rows, window);
        for (int64_t r = 0; r < p.rows; ++r) ++covered[static_cast<size_t>(lo + p.begin + r)];
        if (p.rows > 0) {
          EXPECT_EQ((lo + p.begin - begin) % 128, 0) << "a part starts K-block aligned";
        }
        carried_out += mok::sched::rows_cross(begin, rows, hi);
      }
      EXPECT_LE(carried_out, 1) << "window " << window << " at " << lo;
    }
    for (const auto& [begin, rows] : experts)
      for (int64_t r = begin; r < begin + rows; ++r) EXPECT_EQ(covered[static_cast<size_t>(r)], 1) << "row " << r;
  }
  EXPECT_TRUE(mok::sched::rows_cross(384, 700, 512));
  EXPECT_FALSE(mok::sched::rows_cross(0, 300, 384));  // ends before the cut (padding up to it)
  EXPECT_FALSE(mok::sched::rows_cross(384, 700, 384));  // starts at it
}

// The weight gradient over windows schedules each window's experts only (WgradArgs::expert_range):
// every expert, with rows or without, is owned by one window at least and written by exactly one
// (its rows' windows carry into each other: the owner that writes is the last), and a window's
// owned experts are contiguous.
TEST(ScheduleMath, EveryExpertIsOwnedByContiguousWindows) {
  // 0 rows at the start, between, and at the end of a full layout (offset = its end).
  const std::vector<std::pair<int64_t, int64_t>> experts = {{0, 0}, {0, 300}, {384, 0}, {384, 700},
                                                            {1152, 129}, {1408, 0}, {1408, 128}, {1536, 0}};
  const int64_t total = 1536;
  for (const int64_t window : {int64_t(128), int64_t(256), int64_t(384), int64_t(1024), int64_t(2048)}) {
    std::vector<int> owners(experts.size(), 0), writers(experts.size(), 0);
    for (int64_t lo = 0; lo < total; lo += window) {
      const int64_t hi = std::min(lo + window, total);
      int64_t first = -1, last = -1;
      for (size_t e = 0; e < experts.size(); ++e) {
        const auto [begin, rows] = experts[e];
        if (!mok::sched::window_owns(begin, rows, lo, hi, hi == total)) continue;
        EXPECT_TRUE(last < 0 || last == int64_t(e) - 1) << "window " << window << " at " << lo << ": not contiguous";
        if (first < 0) first = int64_t(e);
        last = int64_t(e);
        ++owners[e];
        writers[e] += !mok::sched::rows_cross(begin, rows, hi);  // else carried out to the next window
      }
    }
    for (size_t e = 0; e < experts.size(); ++e) {
      EXPECT_GE(owners[e], 1) << "expert " << e << ", window " << window;
      EXPECT_EQ(writers[e], 1) << "expert " << e << ", window " << window;
    }
  }
}

// The windows' ends with held rows (window_ends, the bf16 backward over windows): walking the
// windows as the layer does (a ring of `window` rows, the activation budget's end cutting one),
// every expert's weight gradient is run over all its token rows exactly once in row order — the
// rows of each window that runs it, the rows held over from the previous one first, the fp32
// carries joining windows otherwise — and written by one window; held rows fit the hold, only
// cuts before its end hold, what a window holds out the next holds in (and carries likewise), and
// a window's owned experts stay contiguous.
TEST(ScheduleMath, WindowEndsHoldOrCarryEveryCutExpert) {
  // 300, 0, 700, 129, 64, 0, 1000, 128 token rows, padded: a full layout of 2944 rows.
  const std::vector<int32_t> rows = {300, 0, 700, 129, 64, 0, 1000, 128};
  std::vector<int32_t> offset(rows.size(), 0);
  for (size_t e = 1; e < rows.size(); ++e) offset[e] = offset[e - 1] + int32_t(sched::pad_rows(rows[e - 1]));
  const int64_t total = offset.back() + sched::pad_rows(rows.back());
  const int32_t experts = int32_t(rows.size());
  int held_cuts = 0, carried_cuts = 0;
  for (const int64_t window : {int64_t(256), int64_t(384), int64_t(512), int64_t(1024), int64_t(4096)})
    for (const int64_t hold_rows : {int64_t(0), int64_t(128), int64_t(384), int64_t(1024)})
      for (const int64_t end : {int64_t(0), int64_t(1280), total}) {
        const auto where = [&](int64_t lo) {
          return "window " + std::to_string(window) + " hold " + std::to_string(hold_rows) + " end " +
                 std::to_string(end) + " at " + std::to_string(lo);
        };
        std::vector<int64_t> done(rows.size(), 0);  // rows of each expert summed so far, in order
        std::vector<int> writes(rows.size(), 0);
        sched::WindowEnds prev;
        int64_t prev_lo = 0;
        for (int64_t lo = 0; lo < total;) {
          const int64_t hi = sched::window_end(lo, window, total, end);  // (the layer's walk)
          const sched::WindowEnds w = sched::window_ends(offset.data(), rows.data(), experts, lo, hi, hi == total,
                                                         sched::WindowHold{hold_rows, prev_lo, end});
          EXPECT_EQ(w.carry_in, prev.carry_out) << where(lo);
          EXPECT_EQ(w.held_in, prev.held_out) << where(lo);
          EXPECT_EQ(w.held_in_rows, prev.held_out >= 0 ? prev.held_out_rows : 0) << where(lo);
          if (w.held_out >= 0) {
            ++held_cuts;
            EXPECT_LE(w.held_out_rows, hold_rows) << where(lo);
            EXPECT_LT(hi, end) << where(lo);
            EXPECT_EQ(w.held_out_rows % 128, 0) << where(lo);
            EXPECT_EQ(lo + w.held_out_at, offset[size_t(w.held_out)]) << "the held expert starts in its window";
            EXPECT_EQ(w.first + w.owned, w.held_out) << "the held-out expert is next after the owned ones";
          }
          if (w.carry_out >= 0) ++carried_cuts;
          for (int32_t e = w.first; e < w.first + w.owned; ++e) {
            const sched::WindowPart p = sched::window_part(offset[size_t(e)], rows[size_t(e)], lo, hi);
            const int64_t held = e == w.held_in ? w.held_in_rows : 0;
            // K order: this window's run starts where the expert's sums stand (0, or carried in).
            const int64_t start = p.rows > 0 ? lo + p.begin - offset[size_t(e)] - held : 0;
            EXPECT_EQ(start, done[size_t(e)]) << "expert " << e << ", " << where(lo);
            EXPECT_TRUE(e == w.carry_in ? done[size_t(e)] > 0 : held > 0 || done[size_t(e)] == 0)
                << "expert " << e << ", " << where(lo);
            done[size_t(e)] = start + held + p.rows;
            if (e != w.carry_out) ++writes[size_t(e)];
          }
          if (w.held_out >= 0) {  // not run here: the next window runs it from its first row
            EXPECT_EQ(done[size_t(w.held_out)], 0) << where(lo);
          }
          prev = w;
          prev_lo = lo;
          lo = hi;
        }
        for (size_t e = 0; e < rows.size(); ++e) {
          EXPECT_EQ(done[e], rows[e]) << "expert " << e << ", window " << window << " hold " << hold_rows;
          EXPECT_EQ(writes[e], 1) << "expert " << e << ", window " << window << " hold " << hold_rows;
        }
      }
  EXPECT_GT(held_cuts, 10);
  EXPECT_GT(carried_cuts, 10);
}

TEST(ScheduleMath, InterleavedRowsAreRoundRobin) {
  const int32_t counts[3] = {3, 0, 2};
  // Round 0: rank 0, rank 2; round 1: rank 0, rank 2; round 2: rank 0.
  EXPECT_EQ(sched::interleaved_row(counts, 3, 0, 0), 0);
  EXPECT_EQ(sched::interleaved_row(counts, 3, 2, 0), 1);
  EXPECT_EQ(sched::interleaved_row(counts, 3, 0, 1), 2);
  EXPECT_EQ(sched::interleaved_row(counts, 3, 2, 1), 3);
  EXPECT_EQ(sched::interleaved_row(counts, 3, 0, 2), 4);
}

TEST(ScheduleMath, InterleavedRowsAreABijection) {
  const int32_t counts[5] = {7, 1, 0, 4, 4};
  std::set<int64_t> rows;
  for (int r = 0; r < 5; ++r)
    for (int64_t n = 0; n < counts[r]; ++n) rows.insert(sched::interleaved_row(counts, 5, r, n));
  EXPECT_EQ(rows.size(), 16u);
  EXPECT_EQ(*rows.begin(), 0);
  EXPECT_EQ(*rows.rbegin(), 15);
}

TEST(ScheduleMath, Chunks) {
  EXPECT_EQ(sched::num_chunks(0, 256), 0);
  EXPECT_EQ(sched::num_chunks(640, 256), 3);
  EXPECT_EQ(sched::chunk_begin(2, 256), 512);
  EXPECT_EQ(sched::chunk_end(2, 256, 640), 640);
  EXPECT_EQ(sched::chunk_end(0, 256, 640), 256);
}

namespace {

std::vector<std::span<const int32_t>> spans(const mok::Workload& wl) {
  std::vector<std::span<const int32_t>> s;
  for (const auto& in : wl.inputs) s.emplace_back(in.topk_idx);
  return s;
}

// Checks every property the GPU builder must share with the CPU twin.
void check_table(const mok::Workload& wl, int d, const mok::ScheduleTable& s) {
  const auto& shape = wl.shape;
  const int W = shape.world_size();
  const int64_t e_loc = shape.local_experts(), k = shape.top_k;
  ASSERT_EQ(s.total_rows % 128, 0);
  ASSERT_LE(s.total_rows, shape.worst_case_rows());
  // Every route to this rank appears exactly once.
  std::map<std::pair<int, int64_t>, int64_t> expected;  // (src, slot) -> local expert
  for (int r = 0; r < W; ++r)
    for (int64_t slot = 0; slot < shape.tokens_of(r) * k; ++slot) {
      const int32_t e = wl.inputs[r].topk_idx[slot];
      if (e >= 0 && e / e_loc == d) expected[{r, slot}] = e % e_loc;
    }
  std::map<std::pair<int, int64_t>, int64_t> seen;
  for (int64_t le = 0; le < e_loc; ++le) {
    const int64_t b = s.expert_offset[le], n = s.expert_rows[le];
    ASSERT_EQ(s.expert_offset[le + 1] - b, sched::pad_rows(n));
    int64_t last_slot[sched::kMaxWorldSize];
    std::fill(std::begin(last_slot), std::end(last_slot), -1);
    std::vector<int> seq;
    for (int64_t row = b; row < s.expert_offset[le + 1]; ++row) {
      EXPECT_EQ(s.tile_expert[row / 128], le);
      if (row >= b + n) {  // padding at the end of the segment
        EXPECT_EQ(s.src_rank[row], -1);
        EXPECT_EQ(s.src_slot[row], -1);
        continue;
      }
      const int r = s.src_rank[row];
      ASSERT_GE(r, 0);
      const int64_t slot = s.src_slot[row];
      EXPECT_GT(slot, last_slot[r]) << "slot order within (expert, source rank)";
      last_slot[r] = slot;
      EXPECT_TRUE(seen.emplace(std::make_pair(r, slot), le).second) << "route placed twice";
      seq.push_back(r);
    }
    // Round-robin: the sequence of source ranks is rounds of increasing ranks.
    std::vector<int> want;
    for (int64_t round = 0; static_cast<int64_t>(want.size()) < n; ++round)
      for (int r = 0; r < W; ++r)
        if (s.counts[le * W + r] > round) want.push_back(r);
    EXPECT_EQ(seq, want);
  }
  EXPECT_EQ(seen, expected);
}

}  // namespace

class ScheduleBuilder : public ::testing::TestWithParam<std::tuple<int, mok::Routing>> {};

TEST_P(ScheduleBuilder, TableInvariants) {
  const auto [W, routing] = GetParam();
  auto shape = mok::LayerShape::uniform(W, 96, 64, 64, 16, 4);
  shape.tokens[W - 1] = 33;  // T differs per rank
  if (W > 1) shape.tokens[0] = 0;  // and may be 0
  const auto wl = mok::make_workload(shape, routing, 7 + W);
  for (int d = 0; d < W; ++d) {
    SCOPED_TRACE("rank " + std::to_string(d));
    check_table(wl, d, mok::build_schedule_cpu(shape, d, spans(wl)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, ScheduleBuilder,
    ::testing::Combine(::testing::Values(1, 2, 4, 8),
                       ::testing::Values(mok::Routing::Uniform, mok::Routing::Zipf,
                                         mok::Routing::OneExpert, mok::Routing::OneRank,
                                         mok::Routing::EmptySlots)),
    [](const auto& p) {
      return mok::test::param_name("W" + std::to_string(std::get<0>(p.param)) + "_" +
                                   mok::to_string(std::get<1>(p.param)));
    });

// Tile statistics: counted by hand for expert rows {0, 1, 32, 33, 64, 65, 128, 129, 200}; and on
// real tables, tiles agree with the table's own tile list.
TEST(ScheduleTiles, StatsCountPartialTiles) {
  mok::ScheduleTable s;
  s.expert_rows = {0, 1, 32, 33, 64, 65, 128, 129, 200};
  const mok::TileStats t = mok::tile_stats(s);
  EXPECT_EQ(t.rows, 652);
  EXPECT_EQ(t.tiles, 10);
  EXPECT_EQ(t.tiles_le32, 3);  // 1, 32 and the tail of 129
  EXPECT_EQ(t.tiles_le64, 2);  // 33, 64
  EXPECT_DOUBLE_EQ(t.mma_over_useful(false), 7.5 * 128.0 / 652.0);   // 5 full + 5 halves
  EXPECT_DOUBLE_EQ(t.mma_over_useful(true), 6.75 * 128.0 / 652.0);   // 5 full + 2 halves + 3 quarters
  EXPECT_DOUBLE_EQ(mok::tile_stats(mok::ScheduleTable{}).mma_over_useful(true), 1.0);
  const auto shape = mok::LayerShape::uniform(2, 300, 64, 64, 16, 4);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 5);
  for (int d = 0; d < 2; ++d) {
    const mok::ScheduleTable table = mok::build_schedule_cpu(shape, d, spans(wl));
    const mok::TileStats ts = mok::tile_stats(table);
    EXPECT_EQ(ts.tiles, table.num_tiles());
    int64_t token_rows = 0;
    for (int32_t r : table.src_rank) token_rows += r >= 0;
    EXPECT_EQ(ts.rows, token_rows);
  }
}

TEST(ScheduleEdges, EmptyAndSingleTokenExperts) {
  // 2 ranks, 4 experts; only expert 1 (rank 0) gets exactly one token, nothing else is routed.
  auto shape = mok::LayerShape::uniform(2, 3, 64, 64, 4, 1);
  mok::Workload wl = mok::make_workload(shape, mok::Routing::Uniform, 3);
  for (auto& in : wl.inputs) std::fill(in.topk_idx.begin(), in.topk_idx.end(), -1);
  wl.inputs[1].topk_idx[2] = 1;
  const auto s0 = mok::build_schedule_cpu(shape, 0, spans(wl));
  EXPECT_EQ(s0.total_rows, 128);
  EXPECT_EQ(s0.expert_rows[0], 0);
  EXPECT_EQ(s0.expert_rows[1], 1);
  EXPECT_EQ(s0.expert_offset[1], 0);
  EXPECT_EQ(s0.src_rank[0], 1);
  EXPECT_EQ(s0.src_slot[0], 2);
  EXPECT_EQ(s0.tile_expert[0], 1);
  const auto s1 = mok::build_schedule_cpu(shape, 1, spans(wl));
  EXPECT_EQ(s1.total_rows, 0);
  EXPECT_TRUE(s1.src_rank.empty());
}

TEST(ScheduleEdges, AllTokensToOneExpert) {
  auto shape = mok::LayerShape::uniform(4, 200, 64, 64, 8, 1);
  mok::Workload wl = mok::make_workload(shape, mok::Routing::Uniform, 5);
  for (auto& in : wl.inputs) std::fill(in.topk_idx.begin(), in.topk_idx.end(), 5);  // rank 2
  const auto s = mok::build_schedule_cpu(shape, 2, spans(wl));
  EXPECT_EQ(s.expert_rows[1], 800);
  EXPECT_EQ(s.total_rows, 896);
  // Perfect interleave: row i comes from rank i % 4, token i / 4.
  for (int i = 0; i < 800; ++i) {
    EXPECT_EQ(s.src_rank[i], i % 4);
    EXPECT_EQ(s.src_slot[i], i / 4);
  }
}

// The per-tile decode's division (schedule_math.h's div_by) against integer division: every
// divisor below 2^22 at its multiples and their neighbours up to the top of the domain, and every
// divisor up to 1024 over a stride of numerators.
TEST(FastDiv, EqualsIntegerDivisionOverItsDomain) {
  constexpr int32_t kTop = 1 << 22;
  int64_t checked = 0, wrong = 0;
  auto check = [&](int32_t n, const sched::Divisor& v) {
    if (n < 0 || n >= kTop) return;
    if (sched::div_by(n, v) != n / v.d && ++wrong <= 5) ADD_FAILURE() << "n " << n << " d " << v.d;
    ++checked;
  };
  for (int32_t d = 1; d < kTop; ++d) {
    const sched::Divisor v = sched::divisor(d);
    for (int32_t q = 0; q <= kTop / d; ++q)
      for (int32_t o = -1; o <= 1; ++o) check(q * d + o, v);
    if (d <= 1024)
      for (int32_t n = 0; n < kTop; n += 4093) check(n, v);
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_GT(checked, 100000000);
}

// The raster over precomputed divisors gives tile_raster's (m, n) for every tile of a range of
// grid shapes: the weight gradients' (DeepSeek-V3, Qwen3: 12-56 M tiles, 3-56 N tiles) and small
// ones, with short last groups, group_m 1 and group_m above num_m.
TEST(FastDiv, RasterPlanIsTileRaster) {
  int64_t wrong = 0;
  for (int32_t num_m : {1, 2, 3, 7, 8, 9, 12, 16, 24, 32, 48, 56, 57, 112}) {
    for (int32_t n_tiles : {1, 3, 6, 8, 12, 16, 28, 32, 56}) {
      for (int32_t group_m : {1, 2, 3, 8, 16, 100}) {
        const sched::RasterPlan plan = sched::raster_plan(num_m, n_tiles, group_m);
        for (int32_t r = 0; r < num_m * n_tiles; ++r) {
          const sched::TileMN a = sched::tile_raster(r, num_m, n_tiles, group_m);
          const sched::TileMN b = sched::tile_raster(r, plan);
          if ((a.m != b.m || a.n != b.n) && ++wrong <= 5)
            ADD_FAILURE() << num_m << " x " << n_tiles << " group " << group_m << " r " << r;
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}

// expert_tile_raster: every tile exactly once; each expert's tiles take the contiguous range of
// the order that its M tiles span (tile_raster's groups of 8 interleave the two experts at a group
// boundary with a whole group between their halves); an expert's tiles of one N column inside one
// group_m block are consecutive (its weight tile is read together); and where no group holds two
// experts it is tile_raster's order.
TEST(ExpertRaster, EachTileOnceAndNoGroupHoldsTwoExperts) {
  std::mt19937 rng(77);
  int64_t wrong = 0;
  for (int layout = 0; layout < 60; ++layout) {
    std::vector<int32_t> tile_expert;
    const int experts = 1 + int(rng() % 40);
    for (int e = 0; e < experts; ++e)
      for (int t = int(rng() % (layout % 3 == 0 ? 4 : 13)); t > 0; --t) tile_expert.push_back(e);  // (0-tile experts too)
    for (int t = int(rng() % 6); t > 0; --t) tile_expert.push_back(-1);  // the buffer's unused tail
    if (tile_expert.empty()) continue;
    const int32_t num_m = int32_t(tile_expert.size());
    for (int32_t n_tiles : {1, 3, 8, 28}) {
      for (int32_t group_m : {1, 3, 8, 16}) {
        std::vector<int32_t> seen(size_t(num_m) * n_tiles, 0);
        std::vector<int64_t> last_r(size_t(num_m) * n_tiles, -1);  // per (expert run, n): the previous r
        for (int32_t r = 0; r < num_m * n_tiles; ++r) {
          const sched::TileMN t = sched::expert_tile_raster(r, num_m, n_tiles, group_m, tile_expert.data());
          if (t.m < 0 || t.m >= num_m || t.n < 0 || t.n >= n_tiles) {
            if (++wrong <= 5) ADD_FAILURE() << "tile out of range at r " << r;
            continue;
          }
          ++seen[size_t(t.m) * n_tiles + t.n];
          // Each expert's tiles fill the range of r its rows of M tiles span: no group holds
          // two experts, and an expert cut by a group_m boundary runs on across it.
          if (tile_expert[t.m] != tile_expert[r / n_tiles] && ++wrong <= 5)
            ADD_FAILURE() << "r " << r << " ran expert " << tile_expert[t.m] << "'s tile amid expert "
                          << tile_expert[r / n_tiles] << "'s";
          // The previous tile of the same expert and block in this column came right before.
          const int32_t block_first = t.m - t.m % group_m;
          if (t.m > block_first && tile_expert[t.m - 1] == tile_expert[t.m]) {
            const int64_t prev = last_r[size_t(t.m - 1) * n_tiles + t.n];
            if (prev != r - 1 && ++wrong <= 5)
              ADD_FAILURE() << "tile " << t.m << " column " << t.n << " at r " << r << ", its neighbour at " << prev;
          }
          last_r[size_t(t.m) * n_tiles + t.n] = r;
        }
        for (int32_t c : seen)
          if (c != 1 && ++wrong <= 5) ADD_FAILURE() << "a tile ran " << c << " times";
      }
    }
  }
  // One expert everywhere, or experts of exactly group_m tiles: tile_raster's order.
  for (int32_t group_m : {1, 4, 8}) {
    std::vector<int32_t> one(37, 5), aligned;
    for (int e = 0; e < 6; ++e) aligned.insert(aligned.end(), size_t(group_m), e);
    for (const std::vector<int32_t>& te : {one, aligned}) {
      const int32_t num_m = int32_t(te.size());
      for (int32_t r = 0; r < num_m * 28; ++r) {
        const sched::TileMN a = sched::expert_tile_raster(r, num_m, 28, group_m, te.data());
        const sched::TileMN b = sched::tile_raster(r, num_m, 28, group_m);
        if ((a.m != b.m || a.n != b.n) && ++wrong <= 5) ADD_FAILURE() << "group_m " << group_m << " r " << r;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}
