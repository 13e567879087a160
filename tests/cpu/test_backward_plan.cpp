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

// ------------------------------------------------------------------------------------------------
// The backward's GEMM program (backward_program.cu): every tile of the four GEMMs exactly once, a
// D1 tile after its M tile's D2 tiles, an expert's weight-gradient tiles after the D2 tiles of the
// M tiles its rows cover (so every dependency lies at a lower ticket), and the D1 tiles spread
// evenly over the merged part (no run of one kind longer than its share).
namespace {

struct GemmCase {
  std::vector<int32_t> expert_rows;  // per expert (segments padded to 128 rows, as the schedule lays them)
  int32_t n_d2, n_d1, wd_m, wd_n, w1_m, w1_n, group_m;
};

void check_gemm_program(const GemmCase& c, int32_t merge) {
  std::vector<int32_t> begin;
  int32_t rows = 0;
  for (const int32_t r : c.expert_rows) {
    begin.push_back(rows);
    rows += (r + 127) / 128 * 128;
  }
  mk::BwdGemmShape s;
  s.m_tiles = rows / 128;
  s.n_d2 = c.n_d2;
  s.n_d1 = c.n_d1;
  s.group_m = c.group_m;
  s.experts = static_cast<int32_t>(c.expert_rows.size());
  s.wd_m = c.wd_m;
  s.wd_n = c.wd_n;
  s.w1_m = c.w1_m;
  s.w1_n = c.w1_n;
  s.merge = merge;
  const int64_t n = mk::bwd_gemm_tickets(s);
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, int64_t> at;  // (kind, e, m, n) -> ticket
  std::vector<int64_t> d2_last(static_cast<size_t>(s.m_tiles), -1);
  int64_t t = 0;
  for (;; ++t) {
    ASSERT_LE(t, n) << "no End at bwd_gemm_tickets";
    const mk::BwdGemmTask k = mk::bwd_gemm_decode(s, t);
    if (k.kind == mk::kGemmEnd) break;
    ASSERT_TRUE(at.emplace(std::make_tuple(k.kind, k.e, k.m, k.n), t).second) << "tile issued twice at ticket " << t;
    if (k.kind == mk::kGemmD2) {
      ASSERT_TRUE(k.m >= 0 && k.m < s.m_tiles && k.n >= 0 && k.n < s.n_d2);
      d2_last[static_cast<size_t>(k.m)] = t;
    } else if (k.kind == mk::kGemmD1) {
      ASSERT_TRUE(k.m >= 0 && k.m < s.m_tiles && k.n >= 0 && k.n < s.n_d1);
    } else {
      const bool wd = k.kind == mk::kGemmWd;
      ASSERT_TRUE(k.e >= 0 && k.e < s.experts);
      ASSERT_TRUE(k.m >= 0 && k.m < (wd ? s.wd_m : s.w1_m) && k.n >= 0 && k.n < (wd ? s.wd_n : s.w1_n));
    }
  }
  ASSERT_EQ(t, n);
  ASSERT_EQ(static_cast<int64_t>(at.size()), n);
  // Static weight gradients: the counter's tickets are the D2 and D1 tiles, and CTA c of G takes
  // weight-gradient tiles c, c + G, ...: together every one exactly once, whatever G.
  const int64_t dyn = mk::bwd_gemm_dynamic_tickets(s);
  if (merge == 2) {
    ASSERT_EQ(dyn, int64_t(s.m_tiles) * (s.n_d2 + s.n_d1));
    for (const int64_t G : {1, 3, 132}) {
      std::vector<int> seen(static_cast<size_t>(n - dyn), 0);
      for (int64_t cta = 0; cta < G; ++cta)
        for (int64_t w_i = cta; dyn + w_i < n; w_i += G) {
          const mk::BwdGemmTask k = mk::bwd_gemm_decode(s, dyn + w_i);
          ASSERT_TRUE(k.kind == mk::kGemmWd || k.kind == mk::kGemmW1);
          ++seen[static_cast<size_t>(w_i)];
        }
      for (const int v : seen) ASSERT_EQ(v, 1);
    }
  } else {
    ASSERT_EQ(dyn, n);
  }
  // Dependencies: all D2 tiles come first, so a D1 or weight-gradient ticket lies above every D2
  // ticket it waits for; the waits the kernel makes (bwd_gemm_expert_tiles) name real M tiles.
  for (const auto& [key, ticket] : at) {
    const auto [kind, e, m, nn] = key;
    if (kind == mk::kGemmD1) {
      EXPECT_GT(ticket, d2_last[static_cast<size_t>(m)]);
    }
    if (kind == mk::kGemmWd || kind == mk::kGemmW1) {
      const mok::sched::TileMN r = mk::bwd_gemm_expert_tiles(begin[static_cast<size_t>(e)],
                                                             c.expert_rows[static_cast<size_t>(e)]);
      for (int32_t mm = r.m; mm < r.n; ++mm) {
        ASSERT_LT(mm, s.m_tiles);
        EXPECT_GT(ticket, d2_last[static_cast<size_t>(mm)]);
      }
    }
  }
  // Spread: in the merged part, between two D1 tiles at most ceil(w / d1) weight-gradient tiles.
  const int64_t d1 = mk::bwd_gemm_d1_tickets(s), w = mk::bwd_gemm_w_tickets(s);
  if (merge == 1 && d1 > 0 && w > 0) {
    int64_t run = 0, longest = 0;
    for (int64_t u = int64_t(s.m_tiles) * s.n_d2; u < n; ++u) {
      run = mk::bwd_gemm_decode(s, u).kind == mk::kGemmD1 ? 0 : run + 1;
      longest = std::max(longest, run);
    }
    EXPECT_LE(longest, (w + d1 - 1) / d1);
  }
}

TEST(BackwardGemmProgram, EveryTileOnceAfterItsDependencies) {
  // expert rows, n_d2, n_d1, WD tiles (m x n), W1 tiles (m x n), group_m; merged, phased and
  // static orders (static decodes as phased; its counter covers D2 and D1 only)
  for (const int32_t merge : {1, 0, 2}) {
    SCOPED_TRACE(merge == 1 ? "merged" : merge == 0 ? "phased" : "static");
    check_gemm_program(GemmCase{{256, 256, 256, 256}, 8, 28, 56, 8, 32, 28, 8}, merge);  // DeepSeek-V3 at EP 1, 4 experts
    check_gemm_program(GemmCase{{700, 1, 0, 383, 129}, 3, 5, 2, 4, 2, 1, 8}, merge);    // partial and empty experts
    check_gemm_program(GemmCase{{0, 0}, 2, 3, 1, 1, 1, 1, 8}, merge);                   // no rows: zero gradients only
    check_gemm_program(GemmCase{{5000}, 1, 1, 1, 1, 1, 1, 3}, merge);                   // one expert, many tiles
    check_gemm_program(GemmCase{{128, 0, 64, 2048, 1}, 6, 16, 32, 6, 24, 16, 4}, merge);  // Qwen3-like widths
  }
}

}  // namespace
