// Progress of the forward megakernel across ranks, simulated on the CPU: W ranks, each with its
// comm CTAs and its persistent compute CTAs, run the kernel's waits and reports on counters (the
// rules of src/megakernel/forward_kernel.cu: wait_deps, comm_decide, dispatch_step and the
// *_ready checks, restated here from forward_plan.h's header) in random interleavings. Every
// configuration the layer accepts must finish with every counter at its target; a ring of one
// minibatch with ring reuse (which the layer rejects) must be caught as a deadlock, so the
// checker is not vacuous. ForwardPlan (test_forward_plan.cpp) checks one rank's ticket order; this
// adds the cross-rank waits of push dispatch (a sender writes position g of receiver d only once
// d's FC2 of g - S is done) and the comm CTAs' choice between dispatch and combine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "megakernel/forward_plan.h"

namespace {

namespace mk = mok::mk;

struct SimCase {
  int W;
  std::vector<int32_t> totals;  // routed rows per rank (multiples of 128)
  std::vector<int32_t> s_tiles;  // shared-expert token tiles per rank (0: none)
  int32_t mb, slots, n1, n2, n1s, n2s;
  int32_t comm_ctas, compute_ctas;
  int pair, group_m;
  bool push_dispatch, combine_in_epilogue;
};

std::string describe(const SimCase& c) {
  std::ostringstream o;
  o << "W=" << c.W << " totals=";
  for (int32_t t : c.totals) o << t << ",";
  o << " mb=" << c.mb << " S=" << c.slots << " n1=" << c.n1 << " n2=" << c.n2 << " C=" << c.comm_ctas
    << " ctas=" << c.compute_ctas << " pair=" << c.pair << " group_m=" << c.group_m
    << " push=" << c.push_dispatch << " epilogue_combine=" << c.combine_in_epilogue;
  return o.str();
}

struct Rank {
  mk::PlanShape plan;
  int32_t total = 0, G = 0, tiles = 0;
  int32_t next_ticket = 0;
  std::vector<uint32_t> pulled, pushed, fc2_done, fc1_done, s1_done;
};

struct Sim {
  SimCase c;
  std::vector<Rank> ranks;

  explicit Sim(const SimCase& sc) : c(sc) {
    for (int r = 0; r < c.W; ++r) {
      Rank k;
      k.plan = mk::PlanShape{c.mb, c.mb * c.slots, c.n1, c.n2, c.s_tiles[size_t(r)], c.n1s, c.n2s,
                             c.comm_ctas, c.group_m, c.pair};
      k.total = c.totals[size_t(r)];
      k.G = mk::num_positions(k.plan, k.total);
      k.tiles = k.total / 128;
      k.pulled.assign(size_t(k.G), 0);
      k.pushed.assign(size_t(k.G), 0);
      k.fc2_done.assign(size_t(k.G), 0);
      k.fc1_done.assign(size_t(k.tiles), 0);
      k.s1_done.assign(size_t(k.plan.s_tiles), 0);
      ranks.push_back(k);
    }
  }
  int32_t S() const { return c.slots; }
  uint32_t fc2_target(const Rank& k, int32_t g) const {
    return mk::fc2_mb_target(k.plan, mk::mb_rows(k.plan, k.total, g));
  }

  // wait_deps of forward_kernel.cu
  bool deps_met(int r, const mk::Task& t) const {
    const Rank& k = ranks[size_t(r)];
    switch (t.kind) {
      case mk::kTaskFc1: {
        const uint32_t want = uint32_t(c.comm_ctas) * (c.push_dispatch ? uint32_t(c.W) : 1u);
        if (k.pulled[size_t(t.g)] < want) return false;
        return t.g < S() || k.fc2_done[size_t(t.g - S())] >= fc2_target(k, t.g - S());
      }
      case mk::kTaskFc2:
        for (int32_t m = t.m; m < t.m + t.tiles; ++m)
          if (k.fc1_done[size_t(m)] < mk::fc1_tile_target(k.plan)) return false;
        return c.combine_in_epilogue || t.g < S() || k.pushed[size_t(t.g - S())] >= uint32_t(c.comm_ctas);
      case mk::kTaskShared2:
        for (int32_t m = t.m; m < t.m + t.tiles; ++m)
          if (k.s1_done[size_t(m)] < mk::s1_tile_target(k.plan)) return false;
        return true;
      default:
        return true;
    }
  }
  // The reports of a finished task (both warpgroups of every tile).
  void complete(int r, const mk::Task& t) {
    Rank& k = ranks[size_t(r)];
    for (int32_t m = t.m; m < t.m + t.tiles; ++m) {
      if (t.kind == mk::kTaskFc1) k.fc1_done[size_t(m)] += 2;
      if (t.kind == mk::kTaskFc2) k.fc2_done[size_t(t.g)] += 2;
      if (t.kind == mk::kTaskShared1) k.s1_done[size_t(m)] += 2;
    }
  }

  // dispatch_step / dispatch_steps of forward_kernel.cu
  struct Step {
    int32_t g, dest;
    bool empty;
  };
  Step dispatch_step(int r, int32_t step) const {
    if (!c.push_dispatch) return Step{step, r, false};
    const int32_t g = step / c.W;
    const int d = (r + 1 + step % c.W) % c.W;
    return Step{g, d, g >= ranks[size_t(d)].G};
  }
  int32_t dispatch_steps(int r) const {
    if (!c.push_dispatch) return ranks[size_t(r)].G;
    int32_t most = 0;
    for (const Rank& k : ranks) most = std::max(most, k.G);
    return most * c.W;
  }
  // pull_ready / push_dispatch_ready / push_ready
  bool dispatch_ready(int r, int32_t step) const {
    const Step st = dispatch_step(r, step);
    if (st.empty || st.g < S()) return true;
    const Rank& d = ranks[size_t(st.dest)];
    if (c.push_dispatch) return d.fc2_done[size_t(st.g - S())] >= fc2_target(d, st.g - S());
    const mk::MbRows old = mk::mb_rows(d.plan, d.total, st.g - S());
    for (int32_t m = old.begin / 128; m < old.end / 128; ++m)
      if (d.fc1_done[size_t(m)] < mk::fc1_tile_target(d.plan)) return false;
    return true;
  }
  bool combine_ready(int r, int32_t g) const {
    const Rank& k = ranks[size_t(r)];
    return k.fc2_done[size_t(g)] >= fc2_target(k, g);
  }
};

struct Compute {
  int rank;
  bool holding = false, done = false;
  mk::Task task{};
};
struct Comm {
  int rank;
  int32_t pull_next = 0, push_next = 0;
  bool done = false;
};

// Runs one random interleaving to the end. Returns "" when every agent finished, else a
// description of the stuck state.
std::string run(const SimCase& sc, uint32_t seed) {
  Sim sim(sc);
  std::vector<Compute> compute;
  std::vector<Comm> comm;
  for (int r = 0; r < sc.W; ++r) {
    for (int i = 0; i < sc.compute_ctas; ++i) compute.push_back(Compute{r});
    for (int i = 0; i < sc.comm_ctas; ++i) {
      Comm a{r};
      if (sc.combine_in_epilogue) a.push_next = sim.ranks[size_t(r)].G;  // the FC2 epilogue pushes
      comm.push_back(a);
    }
  }
  std::mt19937 rng(seed);
  const size_t agents = compute.size() + comm.size();
  std::vector<size_t> order(agents);
  for (size_t i = 0; i < agents; ++i) order[i] = i;
  for (;;) {
    std::shuffle(order.begin(), order.end(), rng);
    bool progress = false, all_done = true;
    for (size_t i : order) {
      if (i < compute.size()) {
        Compute& a = compute[i];
        if (a.done) continue;
        all_done = false;
        Rank& k = sim.ranks[size_t(a.rank)];
        if (!a.holding) {  // claim_task: tickets until one is not Skip
          for (;;) {
            a.task = mk::decode_ticket(k.plan, k.total, k.next_ticket++);
            if (a.task.kind != mk::kTaskSkip) break;
          }
          if (a.task.kind == mk::kTaskEnd) {
            a.done = true;
          } else {
            a.holding = true;
          }
          progress = true;
        } else if (sim.deps_met(a.rank, a.task)) {
          sim.complete(a.rank, a.task);
          a.holding = false;
          progress = true;
        }
      } else {
        Comm& a = comm[i - compute.size()];
        if (a.done) continue;
        all_done = false;
        const int32_t nsteps = sim.dispatch_steps(a.rank), npos = sim.ranks[size_t(a.rank)].G;
        // comm_decide: the next dispatch step if it is ready, else the next combine push.
        if (a.pull_next < nsteps && sim.dispatch_ready(a.rank, a.pull_next)) {
          const Sim::Step st = sim.dispatch_step(a.rank, a.pull_next);
          if (!st.empty) ++sim.ranks[size_t(st.dest)].pulled[size_t(st.g)];
          ++a.pull_next;
          progress = true;
        } else if (a.push_next < npos && sim.combine_ready(a.rank, a.push_next)) {
          ++sim.ranks[size_t(a.rank)].pushed[size_t(a.push_next)];
          ++a.push_next;
          progress = true;
        } else if (a.pull_next >= nsteps && a.push_next >= npos) {
          a.done = true;
          progress = true;
        }
      }
    }
    if (all_done) break;
    if (!progress) {
      std::ostringstream o;
      o << "stuck: ";
      for (const Compute& a : compute)
        if (a.holding) o << "[rank " << a.rank << " holds kind " << a.task.kind << " g " << a.task.g << " m " << a.task.m << "] ";
      for (const Comm& a : comm)
        if (!a.done) o << "[comm of rank " << a.rank << " at step " << a.pull_next << " push " << a.push_next << "] ";
      return o.str();
    }
  }
  // Every counter at its final target: every tile ran once, every row moved once per comm CTA.
  std::ostringstream bad;
  for (int r = 0; r < sc.W; ++r) {
    const Rank& k = sim.ranks[size_t(r)];
    const uint32_t pulled = uint32_t(sc.comm_ctas) * (sc.push_dispatch ? uint32_t(sc.W) : 1u);
    for (int32_t g = 0; g < k.G; ++g) {
      if (k.pulled[size_t(g)] != pulled) bad << "rank " << r << " pulled[" << g << "] " << k.pulled[size_t(g)] << "; ";
      if (k.fc2_done[size_t(g)] != sim.fc2_target(k, g)) bad << "rank " << r << " fc2_done[" << g << "]; ";
      if (!sc.combine_in_epilogue && k.pushed[size_t(g)] != uint32_t(sc.comm_ctas))
        bad << "rank " << r << " pushed[" << g << "]; ";
    }
    for (int32_t m = 0; m < k.tiles; ++m)
      if (k.fc1_done[size_t(m)] != mk::fc1_tile_target(k.plan)) bad << "rank " << r << " fc1_done[" << m << "]; ";
    for (int32_t m = 0; m < k.plan.s_tiles; ++m)
      if (k.s1_done[size_t(m)] != mk::s1_tile_target(k.plan)) bad << "rank " << r << " s1_done[" << m << "]; ";
  }
  return bad.str().empty() ? "" : "finished with wrong counters: " + bad.str();
}

// Random configurations the layer accepts: a ring of >= 2 minibatches, or one that holds every
// rank's rows (then no position reuses ring rows).
SimCase random_case(std::mt19937& rng) {
  auto pick = [&](std::initializer_list<int32_t> v) { return *(v.begin() + rng() % v.size()); };
  SimCase c;
  c.W = pick({1, 2, 3, 4});
  c.mb = 128 * pick({1, 2, 3});
  int32_t most = 0;
  for (int r = 0; r < c.W; ++r) {
    const int32_t t = 128 * pick({0, 1, 2, 3, 5, 8, 13});
    c.totals.push_back(t);
    c.s_tiles.push_back(pick({0, 1, 3}));
    most = std::max(most, t);
  }
  c.slots = pick({1, 2, 3, 4});
  if (c.slots == 1 && c.mb < most) c.slots = 2;
  c.n1 = pick({1, 2, 3});
  c.n2 = pick({1, 2, 4});
  c.n1s = pick({1, 2});
  c.n2s = pick({1, 2});
  c.comm_ctas = pick({1, 2, 3});
  c.compute_ctas = pick({1, 2, 5});
  c.pair = pick({0, 1});
  c.group_m = pick({0, 1, 8});
  c.push_dispatch = c.W > 1 && pick({0, 1}) == 1;
  c.combine_in_epilogue = pick({0, 1}) == 1;
  return c;
}

TEST(ForwardProgress, EveryAcceptedConfigurationFinishes) {
  std::mt19937 rng(20261130);
  int runs = 0;
  for (int i = 0; i < 400; ++i) {
    const SimCase c = random_case(rng);
    for (uint32_t seed = 0; seed < 5; ++seed, ++runs) {
      const std::string err = run(c, seed + 1000u * uint32_t(i));
      ASSERT_EQ(err, "") << describe(c) << ", seed " << seed;
    }
  }
  EXPECT_EQ(runs, 2000);
}

TEST(ForwardProgress, PushDispatchOneComputeCtaSmallRing) {
  // The tightest push case: one compute CTA per rank, ring of 2 minibatches, uneven totals.
  for (int W : {2, 3, 4}) {
    SimCase c{W, {}, {}, 128, 2, 2, 2, 1, 1, 1, 1, 0, 0, true, false};
    for (int r = 0; r < W; ++r) {
      c.totals.push_back(128 * (3 + 4 * r));
      c.s_tiles.push_back(r % 2);
    }
    for (uint32_t seed = 0; seed < 50; ++seed) ASSERT_EQ(run(c, seed), "") << describe(c) << ", seed " << seed;
  }
}

TEST(ForwardProgress, OneMinibatchRingWithReuseDeadlocks) {
  // FC1(1) waits for FC2(0), which comes after it in ticket order: with one compute CTA that
  // holds FC1(1) nothing can run FC2(0). The layer rejects such a ring; the simulation must see
  // the deadlock (otherwise it could not see any).
  const SimCase c{1, {512}, {0}, 128, 1, 1, 1, 1, 1, 1, 1, 0, 0, false, false};
  EXPECT_NE(run(c, 1).find("stuck"), std::string::npos);
}

}  // namespace
