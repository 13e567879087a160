// The megakernel's work plan (src/megakernel/forward_plan.h): minibatch positions cover the
// routed rows exactly once and reuse ring rows only with their previous occupant; the ticket
// order issues every tile exactly once; every dependency of a ticket lies at a lower ticket (the
// condition under which the persistent kernel cannot deadlock).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include "megakernel/forward_plan.h"

namespace {

using mok::mk::MbRows;
using mok::mk::PlanShape;
using mok::mk::Task;

struct PlanCase {
  int32_t total_rows, mb, ring, n1, n2, s_tiles, n1s, n2s;
};

class ForwardPlan : public ::testing::TestWithParam<PlanCase> {};

TEST_P(ForwardPlan, PositionsCoverRowsAndRingSlotsAreReusedInOrder) {
  const PlanCase c = GetParam();
  PlanShape p{c.mb, c.ring, c.n1, c.n2, c.s_tiles, c.n1s, c.n2s, 4};
  const int32_t G = mok::mk::num_positions(p, c.total_rows);
  const int32_t S = mok::mk::ring_slots(p);
  std::vector<int> covered(c.total_rows, 0);
  for (int32_t g = 0; g < G; ++g) {
    const MbRows r = mok::mk::mb_rows(p, c.total_rows, g);
    ASSERT_LT(r.begin, r.end) << "position " << g << " is empty";
    ASSERT_EQ(r.begin % 128, 0);
    ASSERT_EQ(r.end % 128, 0);
    ASSERT_LE(r.end - r.begin, c.mb);
    ASSERT_GE(r.ring, 0);
    ASSERT_LE(r.ring + (r.end - r.begin), c.ring) << "position " << g << " overflows the ring";
    for (int32_t row = r.begin; row < r.end; ++row) ++covered[row];
    if (g + 1 < G) {
      EXPECT_EQ(r.end - r.begin, c.mb) << "only the last position may be partial";
    }
    // Ring rows of g overlap only those of g - S, g + S, ... (same slot).
    for (int32_t h = 0; h < g; ++h) {
      const MbRows o = mok::mk::mb_rows(p, c.total_rows, h);
      const bool overlap = o.ring < r.ring + (r.end - r.begin) && r.ring < o.ring + (o.end - o.begin);
      if (overlap) {
        EXPECT_EQ((g - h) % S, 0) << "positions " << h << " and " << g << " share ring rows";
      }
    }
    if (g >= S) {
      EXPECT_EQ(mok::mk::mb_rows(p, c.total_rows, g - S).ring, r.ring);
    }
  }
  for (int32_t row = 0; row < c.total_rows; ++row) ASSERT_EQ(covered[row], 1) << "row " << row;
  // Processing order: the last rows first, so the first rows (the last macrobatch processed)
  // are what the ring holds at the end.
  if (G > 0) {
    EXPECT_EQ(mok::mk::mb_rows(p, c.total_rows, std::min(G, S) - 1).end, c.total_rows);
    EXPECT_EQ(mok::mk::mb_rows(p, c.total_rows, G - 1 - (G - 1) % S).begin, 0);
  }
}

void check_tickets(const PlanCase& c, int32_t group_m, int32_t pair);

TEST_P(ForwardPlan, TicketsIssueEveryTileOnceWithDependenciesBelow) {
  // Raster groups: all M tiles of a minibatch, groups that divide them, and groups that leave a
  // short last group.
  // Single tiles and pairs of M tiles (2-CTA clusters).
  for (const int32_t pair : {0, 1})
    for (const int32_t group_m : {0, 1, 3, 8}) {
      SCOPED_TRACE(::testing::Message() << "pair " << pair << ", group_m " << group_m);
      check_tickets(GetParam(), group_m, pair);
    }
}

void check_tickets(const PlanCase& c, int32_t group_m, int32_t pair) {
  PlanShape p{c.mb, c.ring, c.n1, c.n2, c.s_tiles, c.n1s, c.n2s, 4, group_m, pair};
  const int32_t G = mok::mk::num_positions(p, c.total_rows);
  const int32_t S = mok::mk::ring_slots(p);
  const int32_t tiles = c.total_rows / 128;
  // (kind, m, n) -> ticket
  std::map<std::tuple<int, int, int>, int32_t> at;
  std::map<int32_t, int32_t> position_of_tile;
  int32_t t = 0, skips = 0;
  for (;; ++t) {
    ASSERT_LT(t, 10'000'000) << "no end";
    const Task tk = mok::mk::decode_ticket(p, c.total_rows, t);
    if (tk.kind == mok::mk::kTaskEnd) break;
    if (tk.kind == mok::mk::kTaskSkip) {
      ++skips;
      continue;
    }
    ASSERT_GE(tk.tiles, 1);
    ASSERT_LE(tk.tiles, pair ? 2 : 1);
    if (pair) {
      ASSERT_EQ(tk.m % 2, (tk.kind == mok::mk::kTaskShared1 || tk.kind == mok::mk::kTaskShared2)
                              ? 0
                              : (mok::mk::mb_rows(p, c.total_rows, tk.g).begin / 128) % 2)
          << "pairs start at even tiles of their minibatch";
    }
    for (int32_t m = tk.m; m < tk.m + tk.tiles; ++m) {
      const auto key = std::make_tuple(int(tk.kind), int(m), int(tk.n));
      ASSERT_EQ(at.count(key), 0u) << "ticket " << t << " repeats a tile";
      at[key] = t;
      if (tk.kind == mok::mk::kTaskFc1 || tk.kind == mok::mk::kTaskFc2) {
        const MbRows r = mok::mk::mb_rows(p, c.total_rows, tk.g);
        ASSERT_GE(m * 128, r.begin);
        ASSERT_LT(m * 128, r.end);
        position_of_tile[m] = tk.g;
      } else {
        ASSERT_LT(m, c.s_tiles);
      }
    }
  }
  EXPECT_EQ(t, mok::mk::num_tickets(p, G)) << "tickets of the whole order";
  EXPECT_EQ(mok::mk::decode_ticket(p, c.total_rows, t + 5).kind, mok::mk::kTaskEnd);
  const size_t expected = size_t(tiles) * (c.n1 + c.n2) + size_t(c.s_tiles) * (c.n1s + c.n2s);
  ASSERT_EQ(at.size(), expected);
  if (!pair) {
    EXPECT_EQ(int64_t(t - skips), int64_t(expected));
  }
  // Dependencies point to lower tickets.
  for (const auto& [key, ticket] : at) {
    const auto [kind, m, n] = key;
    if (kind == mok::mk::kTaskFc2) {
      for (int j = 0; j < c.n1; ++j) {
        EXPECT_LT(at.at({mok::mk::kTaskFc1, m, j}), ticket);
      }
      const int32_t g = position_of_tile.at(m);
      if (g >= S) {  // ring y rows: the previous occupant's FC2 tiles (pushed after them)
        const MbRows o = mok::mk::mb_rows(p, c.total_rows, g - S);
        for (int32_t mo = o.begin / 128; mo < o.end / 128; ++mo)
          for (int j = 0; j < c.n2; ++j) {
            EXPECT_LT(at.at({mok::mk::kTaskFc2, mo, j}), ticket);
          }
      }
    } else if (kind == mok::mk::kTaskFc1) {
      const int32_t g = position_of_tile.at(m);
      if (g >= S) {  // ring h rows: FC2 of the previous occupant
        const MbRows o = mok::mk::mb_rows(p, c.total_rows, g - S);
        for (int32_t mo = o.begin / 128; mo < o.end / 128; ++mo)
          for (int j = 0; j < c.n2; ++j) {
            EXPECT_LT(at.at({mok::mk::kTaskFc2, mo, j}), ticket);
          }
      }
    } else if (kind == mok::mk::kTaskShared2) {
      for (int j = 0; j < c.n1s; ++j) {
        EXPECT_LT(at.at({mok::mk::kTaskShared1, m, j}), ticket);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ForwardPlan,
    ::testing::Values(PlanCase{0, 256, 512, 4, 2, 0, 0, 0},             // no rows at all
                      PlanCase{0, 256, 512, 4, 2, 3, 2, 2},             // only the shared expert
                      PlanCase{128, 256, 512, 4, 2, 0, 0, 0},           // one partial minibatch
                      PlanCase{1920, 384, 100000, 16, 28, 0, 0, 0},     // one macrobatch
                      PlanCase{1920, 384, 768, 6, 8, 2, 4, 8},          // 3 macrobatches, last short
                      PlanCase{2048, 128, 256, 3, 5, 1, 1, 5},          // many 1-tile minibatches
                      PlanCase{2176, 256, 1024, 2, 2, 5, 3, 2},         // partial minibatch and macro
                      PlanCase{4096, 512, 1024, 1, 1, 0, 0, 0}),        // exact fit
    [](const ::testing::TestParamInfo<PlanCase>& i) { return "case" + std::to_string(i.index); });

}  // namespace
