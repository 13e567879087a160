// The backward megakernel's work plan (src/megakernel/backward_plan.h; no kernel uses it yet):
// the ticket order issues every tile exactly once, every dependency of a ticket lies at a lower
// ticket (the condition under which a persistent kernel whose CTAs claim tickets in order cannot
// deadlock), and a simulation of comm CTAs and compute CTAs running the plan's waits and counter
// updates in random interleavings always finishes with every counter at its target.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "megakernel/backward_plan.h"

namespace {

namespace mk = mok::mk;

struct BwdCase {
  std::vector<int32_t> expert_rows;  // per local expert (each padded to 128 rows)
  int32_t mb, n_d2, n_d1, wd_units, w1_units, s_tiles, n_d2s, swd_units, sw1_units;
};

struct Layout {
  int32_t total_rows = 0;
  std::vector<int32_t> tile_begin, tile_end;  // per expert, routed M tiles [begin, end)
};

Layout layout_of(const BwdCase& c) {
  Layout l;
  for (const int32_t rows : c.expert_rows) {
    l.tile_begin.push_back(l.total_rows / 128);
    l.total_rows += (rows + 127) / 128 * 128;
    l.tile_end.push_back(l.total_rows / 128);
  }
  return l;
}

mk::BwdPlanShape shape_of(const BwdCase& c, int32_t comm_ctas = 4) {
  mk::BwdPlanShape p;
  p.mb_rows = c.mb;
  p.experts = static_cast<int32_t>(c.expert_rows.size());
  p.n_d2 = c.n_d2;
  p.n_d1 = c.n_d1;
  p.wd_units = c.wd_units;
  p.w1_units = c.w1_units;
  p.s_tiles = c.s_tiles;
  p.n_d2s = c.n_d2s;
  p.swd_units = c.swd_units;
  p.sw1_units = c.sw1_units;
  p.comm_ctas = comm_ctas;
  return p;
}

// All tasks in ticket order, up to the first End (which must come at bwd_num_tickets).
std::vector<mk::BwdTask> all_tasks(const mk::BwdPlanShape& p, int32_t total_rows) {
  std::vector<mk::BwdTask> tasks;
  for (int32_t t = 0;; ++t) {
    if (t > 10'000'000) {
      ADD_FAILURE() << "no end";
      break;
    }
    const mk::BwdTask k = mk::bwd_decode_ticket(p, total_rows, t);
    if (k.kind == mk::kBwdEnd) break;
    tasks.push_back(k);
  }
  return tasks;
}

class BackwardPlan : public ::testing::TestWithParam<BwdCase> {};

TEST_P(BackwardPlan, TicketsIssueEveryTileOnceWithDependenciesBelow) {
  const BwdCase& c = GetParam();
  const Layout l = layout_of(c);
  const mk::BwdPlanShape p = shape_of(c);
  const std::vector<mk::BwdTask> tasks = all_tasks(p, l.total_rows);
  ASSERT_EQ(int64_t(tasks.size()), mk::bwd_num_tickets(p, l.total_rows));
  EXPECT_EQ(mk::bwd_decode_ticket(p, l.total_rows, int32_t(tasks.size()) + 3).kind, mk::kBwdEnd);
  // (kind, m, n, e) -> ticket
  std::map<std::tuple<int, int, int, int>, int32_t> at;
  for (int32_t t = 0; t < int32_t(tasks.size()); ++t) {
    const mk::BwdTask& k = tasks[size_t(t)];
    const auto key = std::make_tuple(int(k.kind), int(k.m), int(k.n), int(k.e));
    ASSERT_EQ(at.count(key), 0u) << "ticket " << t << " repeats a tile";
    at[key] = t;
    switch (k.kind) {
      case mk::kBwdD2:
      case mk::kBwdD1: {
        const mk::MbRows r = mk::bwd_mb_rows(p, l.total_rows, k.g);
        ASSERT_GE(k.m * 128, r.begin) << "ticket " << t;
        ASSERT_LT(k.m * 128, r.end) << "ticket " << t;
        ASSERT_LT(k.n, k.kind == mk::kBwdD2 ? c.n_d2 : c.n_d1);
        break;
      }
      case mk::kBwdSharedD2:
      case mk::kBwdSharedD1:
        ASSERT_LT(k.m, c.s_tiles);
        ASSERT_LT(k.n, k.kind == mk::kBwdSharedD2 ? c.n_d2s : c.n_d1);
        break;
      case mk::kBwdWd:
      case mk::kBwdW1:
        ASSERT_LT(k.e, p.experts);
        ASSERT_LT(k.n, k.kind == mk::kBwdWd ? c.wd_units : c.w1_units);
        break;
      default:
        ASSERT_LT(k.n, k.kind == mk::kBwdSharedWd ? c.swd_units : c.sw1_units);
        ASSERT_GT(c.s_tiles, 0);
    }
  }
  const int64_t tiles = l.total_rows / 128;
  const size_t expected = size_t(tiles * (c.n_d2 + c.n_d1) + int64_t(c.s_tiles) * (c.n_d2s + c.n_d1) +
                                 (c.s_tiles > 0 ? c.swd_units + c.sw1_units : 0) +
                                 int64_t(c.expert_rows.size()) * (c.wd_units + c.w1_units));
  ASSERT_EQ(at.size(), expected);
  // Dependencies lie at lower tickets.
  const auto d2_before = [&](int32_t m, int32_t ticket, int kind, int32_t n_tiles) {
    for (int32_t j = 0; j < n_tiles; ++j) EXPECT_LT(at.at({kind, m, j, -1}), ticket) << "tile " << m;
  };
  for (const auto& [key, ticket] : at) {
    const auto [kind, m, n, e] = key;
    if (kind == mk::kBwdD1) d2_before(m, ticket, mk::kBwdD2, c.n_d2);
    if (kind == mk::kBwdSharedD1) d2_before(m, ticket, mk::kBwdSharedD2, c.n_d2s);
    if (kind == mk::kBwdWd || kind == mk::kBwdW1)
      for (int32_t mm = l.tile_begin[size_t(e)]; mm < l.tile_end[size_t(e)]; ++mm) d2_before(mm, ticket, mk::kBwdD2, c.n_d2);
    if (kind == mk::kBwdSharedWd || kind == mk::kBwdSharedW1)
      for (int32_t mm = 0; mm < c.s_tiles; ++mm) d2_before(mm, ticket, mk::kBwdSharedD2, c.n_d2s);
  }
}

// Comm CTAs (each pulls its share of every position in order and pushes a position once its D1
// tiles are done) and compute CTAs (each claims the next ticket, waits for its dependencies,
// then reports), stepped in random order until nobody can move. Counters and targets as in
// backward_plan.h. withhold_last_pull: one comm CTA never pulls the last position (a peer that
// never delivers), which must stall the plan (so the check below is not vacuous).
struct SimResult {
  int64_t tickets = 0, claimed = 0, done = 0, pushes = 0, expected_pushes = 0;
};

SimResult simulate(const BwdCase& c, int32_t comm_ctas, int32_t compute_ctas, uint32_t seed,
                   bool withhold_last_pull = false) {
  const Layout l = layout_of(c);
  const mk::BwdPlanShape p = shape_of(c, comm_ctas);
  const int32_t G = mk::bwd_num_positions(p, l.total_rows);
  const int32_t tiles = l.total_rows / 128;
  std::vector<uint32_t> pulled(size_t(G), 0), d1_done(size_t(G), 0), d2_done(size_t(tiles), 0),
      sd2_done(size_t(c.s_tiles), 0);
  std::vector<int32_t> comm_pull(size_t(comm_ctas), 0), comm_push(size_t(comm_ctas), 0);
  SimResult res;
  res.tickets = mk::bwd_num_tickets(p, l.total_rows);
  res.expected_pushes = int64_t(G) * comm_ctas;
  std::vector<mk::BwdTask> held(size_t(compute_ctas), mk::BwdTask{mk::kBwdEnd, -1, -1, -1, -1});
  std::vector<bool> holding(size_t(compute_ctas), false);
  const auto d2_complete = [&](int32_t b, int32_t e) {
    for (int32_t m = b; m < e; ++m)
      if (d2_done[size_t(m)] < mk::d2_tile_target(p)) return false;
    return true;
  };
  const auto ready = [&](const mk::BwdTask& k) {
    switch (k.kind) {
      case mk::kBwdD2: return pulled[size_t(k.g)] >= uint32_t(comm_ctas);
      case mk::kBwdD1: return d2_done[size_t(k.m)] >= mk::d2_tile_target(p);
      case mk::kBwdSharedD1: return sd2_done[size_t(k.m)] >= mk::sd2_tile_target(p);
      case mk::kBwdWd:
      case mk::kBwdW1: return d2_complete(l.tile_begin[size_t(k.e)], l.tile_end[size_t(k.e)]);
      case mk::kBwdSharedWd:
      case mk::kBwdSharedW1:
        for (int32_t m = 0; m < c.s_tiles; ++m)
          if (sd2_done[size_t(m)] < mk::sd2_tile_target(p)) return false;
        return true;
      default: return true;  // SD2: no communication
    }
  };
  const auto pulls_of = [&](int j) { return withhold_last_pull && j == 0 ? G - 1 : G; };
  const auto can_push = [&](int j) {
    const int32_t g = comm_push[size_t(j)];
    return g < G && d1_done[size_t(g)] >= mk::d1_mb_target(p, mk::bwd_mb_rows(p, l.total_rows, g));
  };
  std::mt19937 rng(seed);
  for (int64_t steps = 0; steps < 100'000'000; ++steps) {
    std::vector<int> movable;  // compute CTA i -> i, comm CTA j -> compute_ctas + j
    for (int i = 0; i < compute_ctas; ++i)
      if ((!holding[size_t(i)] && res.claimed < res.tickets) || (holding[size_t(i)] && ready(held[size_t(i)])))
        movable.push_back(i);
    for (int j = 0; j < comm_ctas; ++j)
      if (comm_pull[size_t(j)] < pulls_of(j) || can_push(j)) movable.push_back(compute_ctas + j);
    if (movable.empty()) break;
    const int a = movable[rng() % movable.size()];
    if (a < compute_ctas) {
      if (!holding[size_t(a)]) {
        held[size_t(a)] = mk::bwd_decode_ticket(p, l.total_rows, int32_t(res.claimed++));
        holding[size_t(a)] = true;
      } else {
        const mk::BwdTask& k = held[size_t(a)];
        if (k.kind == mk::kBwdD2) d2_done[size_t(k.m)] += 2;  // both consumer warpgroups
        if (k.kind == mk::kBwdD1) d1_done[size_t(k.g)] += 2;
        if (k.kind == mk::kBwdSharedD2) sd2_done[size_t(k.m)] += 2;
        ++res.done;
        holding[size_t(a)] = false;
      }
    } else {
      const int j = a - compute_ctas;
      if (can_push(j) && (comm_pull[size_t(j)] >= pulls_of(j) || rng() % 2)) {
        ++comm_push[size_t(j)];
        ++res.pushes;
      } else {
        ++pulled[size_t(comm_pull[size_t(j)]++)];
      }
    }
  }
  return res;
}

TEST_P(BackwardPlan, CommAndComputeAlwaysFinish) {
  for (const int32_t comm_ctas : {1, 3})
    for (const int32_t compute_ctas : {1, 2, 7})
      for (uint32_t seed = 0; seed < 20; ++seed) {
        SCOPED_TRACE(::testing::Message() << "C=" << comm_ctas << " ctas=" << compute_ctas << " seed=" << seed);
        const SimResult r = simulate(GetParam(), comm_ctas, compute_ctas, seed);
        ASSERT_EQ(r.claimed, r.tickets) << "stalled: not every ticket was claimed";
        ASSERT_EQ(r.done, r.tickets) << "stalled: a claimed task never became ready";
        ASSERT_EQ(r.pushes, r.expected_pushes) << "a position was never pushed";
      }
}

// The checker catches a stall: with one comm CTA withholding the last position's pull, the
// plan cannot finish (the last position's D2 tiles never become ready).
TEST(BackwardPlanSim, DetectsAStall) {
  const BwdCase c{{700, 1, 0, 383, 129}, 384, 3, 5, 2, 4, 2, 1, 1, 2};
  const SimResult r = simulate(c, 3, 4, 7, /*withhold_last_pull=*/true);
  EXPECT_LT(r.done, r.tickets);
  EXPECT_LT(r.pushes, r.expected_pushes);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BackwardPlan,
    ::testing::Values(
        // expert rows, M, n_d2, n_d1, wd, w1, shared tiles, n_d2s, swd, sw1
        BwdCase{{0, 0}, 256, 4, 2, 3, 5, 0, 0, 0, 0},               // no rows at all
        BwdCase{{0}, 256, 4, 2, 3, 5, 3, 2, 4, 6},                   // only the shared expert
        BwdCase{{100}, 256, 4, 2, 3, 5, 0, 0, 0, 0},                 // one partial position
        BwdCase{{700, 1, 0, 383, 129}, 384, 3, 5, 2, 4, 2, 1, 1, 2},  // experts across positions
        BwdCase{{128, 128, 128, 128}, 128, 2, 3, 1, 1, 1, 1, 1, 1},  // one tile per position
        BwdCase{{2048, 2048}, 512, 16, 28, 56, 32, 0, 0, 0, 0},      // DeepSeek-V3-like, 4096 rows
        BwdCase{{300, 0, 0, 1000}, 256, 1, 1, 1, 1, 5, 3, 2, 2}),    // empty experts in between
    [](const ::testing::TestParamInfo<BwdCase>& i) { return "case" + std::to_string(i.index); });

}  // namespace
