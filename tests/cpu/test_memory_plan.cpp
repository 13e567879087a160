// The memory planner (include/mok/memory.hpp) against the layer memory measured on one H200 at
// c5c4276 (issue 19: cudaMemGetInfo around one Layer after forward + backward, weights and inputs
// not counted), less the packed gate/up copy the layer held then, and two EP-8 figures of the
// issue's formulas; the plan's structure. (The issue's
// DeepSeek-V3 EP-8 figure, 21.5 GB, is not reproduced: the plan says 24.8 GB there, of which the
// ring is capped by 32-bit offsets at 299k of the 528k worst-case rows; the EP-1 measurements,
// which it matches within 1%, are the check.)
#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>

#include "mok/errors.hpp"
#include "mok/memory.hpp"
#include "megakernel/fp8_backward_layout.h"

namespace {

// The training memory model at DeepSeek-V3 EP 8: the shared workspace and a ring of 8192 rows
// (the one a 2 GB workspace leaves, RingForWorkspaceIsTheLargestThatFits).
// The resident mode (every routed row kept, each layer its own buffers): what these tests measure
// against unless they say otherwise.
mok::Config resident_config() {
  mok::Config cfg;
  cfg.share_workspace = false;
  cfg.workspace_budget_bytes = 0;
  return cfg;
}

mok::Config training_config() {
  mok::Config cfg = resident_config();
  cfg.share_workspace = true;
  cfg.macrobatch_tokens = 8192;
  return cfg;
}

// `call()` throws mok::Error naming `argument`; `what` says what was wrongly accepted otherwise.
template <class Fn>
void expect_refused(Fn&& call, const char* argument, const char* what) {
  try {
    (void)call();
    ADD_FAILURE() << "accepted " << what;
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), argument) << what << ": " << e.what();
  }
}

struct Measured {
  const char* name;
  int world;
  int64_t T, H, I, E, k;
  double gb;  // measured (EP 1) or from the formulas (EP 8)
};

// DeepSeek-V3 (E 256 and one EP-8 rank's 32), Qwen3-235B and Qwen3-30B-A3B at T = 8192.
const Measured kCases[] = {
    {"dsv3_ep1", 1, 8192, 7168, 2048, 256, 8, 21.6},     {"dsv3_e32_ep1", 1, 8192, 7168, 2048, 32, 8, 6.9},
    {"qwen3_235b_ep1", 1, 8192, 4096, 1536, 128, 8, 6.7}, {"qwen3_30b_ep1", 1, 8192, 2048, 768, 128, 8, 2.5},
    {"qwen3_235b_ep8", 8, 8192, 4096, 1536, 128, 8, 18.7},
    {"qwen3_30b_ep8", 8, 8192, 2048, 768, 128, 8, 9.4},
};

TEST(MemoryPlan, MatchesTheMeasuredLayerMemory) {
  for (const Measured& c : kCases) {
    const auto shape = mok::LayerShape::uniform(c.world, c.T, c.H, c.I, c.E, c.k);
    // The figures predate the activation budget: at EP 8 the default ring is below the worst case
    // (the backward runs over windows), and the saved gate/up rows are left out here.
    mok::Config cfg = resident_config();
    cfg.activation_budget_bytes = 0;
    const mok::MemoryPlan p = mok::plan_memory(shape, cfg, 0, 132);
    // The layer measured then also held a packed copy of its gate/up weights (E_loc * 2I * H bf16),
    // which it no longer allocates (FC1 reads w_gate and w_up where they are).
    const double w1p_gb = double(c.E / c.world * 2 * c.I * c.H * 2) * 1e-9;
    const double gb = double(p.total()) * 1e-9, want = c.gb - w1p_gb;
    std::printf("[memory] %-15s plan %6.2f GB (figure %5.1f GB less the packed weights' %.2f GB)\n", c.name, gb, c.gb,
                w1p_gb);
    EXPECT_NEAR(gb, want, 0.03 * c.gb) << c.name << "\n" << p.table();
  }
}

// Config::share_workspace: what no later call reads goes to the workspace (counted once for the
// layers on a communicator), the symmetric windows but the routing's among it; with a ring below
// the worst case (the backward over windows) also the rings, gu and the carries; a push-dispatch
// ring stays the layer's (a symmetric window the peers write).
TEST(MemoryPlan, SharedWorkspaceHoldsWhatNoLaterCallReads) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  const auto in_ws = [](const mok::MemoryPlan& p, const char* name) {
    for (const auto& b : p.buffers)
      if (b.name == name) return b.workspace;
    ADD_FAILURE() << "no buffer " << name;
    return false;
  };
  mok::Config cfg = resident_config();
  // EP 1: the default ring holds the worst case (a resident backward); at EP 8 it is capped below.
  const auto ep1 = mok::LayerShape::uniform(1, 8192, 7168, 2048, 256, 8);
  const mok::MemoryPlan own = mok::plan_memory(ep1, cfg, 0, 132);
  EXPECT_EQ(own.workspace(), 0);
  cfg.share_workspace = true;
  const mok::MemoryPlan resident = mok::plan_memory(ep1, cfg, 0, 132);
  EXPECT_EQ(resident.total(), own.total());
  EXPECT_TRUE(in_ws(resident, "y_ring") && in_ws(resident, "dy_rows"));
  // The symmetric windows but the routing's: the backward stages x and d_out again and reads no
  // forward row from the combine slots.
  for (const char* n : {"window.x", "window.combine", "window.d_out", "window.router_weights", "window.d_weights"})
    EXPECT_TRUE(in_ws(resident, n)) << n;
  EXPECT_FALSE(in_ws(resident, "x_ring") || in_ws(resident, "gu") || in_ws(resident, "window.routing"));
  cfg.macrobatch_tokens = 32768;  // windows: the rings, gu and carries join
  const mok::MemoryPlan windows = mok::plan_memory(shape, cfg, 0, 132);
  for (const char* n : {"x_ring", "h_ring", "y_ring", "gu", "dy_rows", "bwd_carry", "bwd_windows"})
    EXPECT_TRUE(in_ws(windows, n)) << n;
  EXPECT_FALSE(in_ws(windows, "window.routing") || in_ws(windows, "schedule") || in_ws(windows, "gu_saved"));
  EXPECT_EQ(windows.per_layer() + windows.workspace(), windows.total());
  EXPECT_NE(windows.table().find("total"), std::string::npos);
  EXPECT_NE(windows.table().find("workspace the layers"), std::string::npos);
  std::printf("[memory] dsv3 ep8 T 8192, ring 32768, shared workspace: per layer %.2f GB, workspace %.2f GB\n",
              double(windows.per_layer()) * 1e-9, double(windows.workspace()) * 1e-9);
  cfg.dispatch = mok::DispatchPath::Push;
  EXPECT_FALSE(in_ws(mok::plan_memory(shape, cfg, 0, 132), "x_ring")) << "a push ring is a symmetric window";
}

TEST(MemoryPlan, NamesEveryBufferOnceWithItsScope) {
  const auto shape = mok::LayerShape::uniform(2, 700, 1024, 512, 16, 4, 512);
  for (const auto dispatch : {mok::DispatchPath::Pull, mok::DispatchPath::Push}) {
    for (const auto path : {mok::ForwardPath::Megakernel, mok::ForwardPath::Unfused}) {
      mok::Config cfg = resident_config();
      cfg.forward_path = path;
      cfg.dispatch = dispatch;
      const mok::MemoryPlan p = mok::plan_memory(shape, cfg, 1, 132);
      std::set<std::string> names;
      for (const auto& b : p.buffers) {
        EXPECT_GT(b.bytes, 0) << b.name;
        EXPECT_TRUE(names.insert(b.name).second) << "twice: " << b.name;
      }
      for (const char* n : {"window.x", "window.combine", "schedule", "gu", "dy_rows", "gu_s"})
        EXPECT_TRUE(p.has(n)) << n;
      const bool mk = path == mok::ForwardPath::Megakernel;
      EXPECT_EQ(p.has("x_ring"), mk);
      EXPECT_EQ(p.has("x_routed"), !mk);
      EXPECT_GT(p.total(mok::MemoryScope::Saved), 0);
      EXPECT_EQ(p.total(), p.total(mok::MemoryScope::Layer) + p.total(mok::MemoryScope::Saved) +
                               p.total(mok::MemoryScope::Backward));
      EXPECT_GT(p.symmetric(), 0);
      EXPECT_NE(p.table().find("total"), std::string::npos);
    }
  }
  EXPECT_THROW((void)mok::plan_memory(shape, resident_config(), 0, 132).bytes("no such buffer"), mok::Error);
  EXPECT_THROW((void)mok::plan_memory(shape, resident_config(), 2, 132), mok::Error);  // rank out of range
}

}  // namespace

// Config::activation_budget_bytes: a forward with a ring below the worst case keeps the gate/up
// rows (4I bytes each) of the budget, in whole 128-row tiles, at most the worst case; automatic:
// the rows of uniform routing, an eighth more and every expert's padding; 0: none (full
// recompute). A ring that holds the worst case keeps every row anyway (no gu_saved).
TEST(MemoryPlan, ActivationBudgetSavesWholeTilesOfGateUpRows) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);  // DeepSeek-V3, EP 8
  mok::Config cfg = resident_config();
  cfg.macrobatch_tokens = 32768;
  const int64_t row = 4 * 2048;
  const int64_t uniform = 8192 * 8, automatic = (uniform + uniform / 8 + 32 * 127 + 127) / 128 * 128;
  EXPECT_EQ(cfg.resolved_saved_rows(shape), automatic);
  EXPECT_EQ(mok::plan_memory(shape, cfg, 0, 132).bytes("gu_saved"), automatic * row);
  EXPECT_STREQ(mok::plan_memory(shape, cfg, 0, 132).backward_mode(), "saved");
  cfg.activation_budget_bytes = 1000 * row + 5;  // rounded down to 896 rows (7 tiles)
  EXPECT_EQ(cfg.resolved_saved_rows(shape), 896);
  EXPECT_EQ(mok::plan_memory(shape, cfg, 0, 132).bytes("gu_saved"), 896 * row);
  cfg.activation_budget_bytes = int64_t(1) << 50;  // capped at the worst case
  EXPECT_EQ(cfg.resolved_saved_rows(shape), shape.worst_case_rows());
  cfg.activation_budget_bytes = 0;
  const mok::MemoryPlan none = mok::plan_memory(shape, cfg, 0, 132);
  EXPECT_FALSE(none.has("gu_saved"));
  EXPECT_STREQ(none.backward_mode(), "recompute");
  cfg.activation_budget_bytes = -2;
  expect_refused([&] { return mok::plan_memory(shape, cfg, 0, 132); }, "config.activation_budget_bytes",
                 "a budget of -2 bytes");
  // Resident (EP 1, the default ring holds the worst case): no saved rows beyond gu itself.
  const auto ep1 = mok::LayerShape::uniform(1, 8192, 7168, 2048, 256, 8);
  const mok::MemoryPlan resident = mok::plan_memory(ep1, resident_config(), 0, 132);
  EXPECT_FALSE(resident.has("gu_saved"));
  EXPECT_STREQ(resident.backward_mode(), "resident");
}

// Issue 19's bars at DeepSeek-V3, EP 8, T = 8192, with the shared workspace and a ring of 8192
// rows: per layer at most 1.35 GB with the automatic activation budget and 10 MB with full
// recompute, the workspace at most 2 GB. The plan sizes by the worst case or a budget, so these
// hold for every routing.
TEST(MemoryPlan, DeepSeekV3AtEp8MeetsTheTrainingBars) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  mok::Config cfg = training_config();
  const mok::MemoryPlan saved = mok::plan_memory(shape, cfg, 0, 132);
  cfg.activation_budget_bytes = 0;
  const mok::MemoryPlan recompute = mok::plan_memory(shape, cfg, 0, 132);
  std::printf("[memory] dsv3 ep8 ring 8192: per layer %.3f GB saved / %.4f GB recompute, workspace %.3f GB\n",
              double(saved.per_layer()) * 1e-9, double(recompute.per_layer()) * 1e-9, double(saved.workspace()) * 1e-9);
  EXPECT_STREQ(saved.backward_mode(), "saved");
  EXPECT_LE(saved.per_layer(), int64_t(1.35e9));
  EXPECT_LE(recompute.per_layer(), int64_t(10e6));
  EXPECT_LE(saved.workspace(), int64_t(2e9));
  EXPECT_EQ(saved.workspace(), recompute.workspace());
}

// The backward over windows holds the rows of an expert cut by a window's end in the gu scratch
// (MemoryPlan::hold_rows, layer_backward_windows.cu): 4I / (4H + 2I) of the ring's rows, no bytes
// of their own; none with full recompute (FC1 again fills the scratch), the backward program or
// FP8 (they carry), or every row resident (no windows).
TEST(MemoryPlan, HoldRowsAreWhatTheGateUpScratchTakes) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  mok::Config cfg = training_config();
  const mok::MemoryPlan saved = mok::plan_memory(shape, cfg, 0, 132);
  ASSERT_STREQ(saved.backward_mode(), "saved");
  EXPECT_EQ(saved.hold_rows, 2048) << "ring 8192 x 4I / (4H + 2I)";
  EXPECT_EQ(saved.hold_rows * (4 * 7168 + 2 * 2048), saved.bytes("gu"));
  mok::Config c = cfg;
  c.activation_budget_bytes = 0;
  EXPECT_EQ(mok::plan_memory(shape, c, 0, 132).hold_rows, 0) << "full recompute";
  c = cfg;
  c.backward_path = mok::BackwardPath::Fused;
  EXPECT_EQ(mok::plan_memory(shape, c, 0, 132).hold_rows, 0) << "the backward program";
  c = cfg;
  c.precision = mok::Precision::FP8;
  EXPECT_EQ(mok::plan_memory(shape, c, 0, 132).hold_rows, 0) << "FP8";
  c = resident_config();  // every row resident at EP 1
  EXPECT_EQ(mok::plan_memory(mok::LayerShape::uniform(1, 8192, 7168, 2048, 256, 8), c, 0, 132).hold_rows, 0);
  // Qwen3-30B-A3B at EP 8: the hold is the ring's share, capped by the ring.
  const auto qwen = mok::LayerShape::uniform(8, 8192, 2048, 768, 128, 8);
  const mok::MemoryPlan q = mok::plan_memory(qwen, cfg, 0, 132);
  EXPECT_GT(q.hold_rows, 0);
  EXPECT_LE(q.hold_rows * (4 * 2048 + 2 * 768), q.bytes("gu"));
  EXPECT_EQ(q.hold_rows % 128, 0);
}

// mok::ring_for_workspace: the largest ring below the worst case whose shared workspace fits the
// budget (one more minibatch would not), the smallest one's need named when nothing fits, and 0
// when the worst case is within two minibatches (nothing to choose).
TEST(MemoryPlan, RingForWorkspaceIsTheLargestThatFits) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  const mok::Config cfg = resident_config();
  const int64_t ring = mok::ring_for_workspace(shape, cfg, 0, 132, int64_t(2e9));
  const int64_t mb = cfg.resolved_minibatch(shape, 132);
  ASSERT_GT(ring, 0);
  EXPECT_EQ(ring % mb, 0);
  mok::Config at = cfg;
  at.share_workspace = true;
  at.macrobatch_tokens = ring;
  EXPECT_LE(mok::plan_memory(shape, at, 0, 132).workspace(), int64_t(2e9));
  at.macrobatch_tokens = ring + mb;
  EXPECT_GT(mok::plan_memory(shape, at, 0, 132).workspace(), int64_t(2e9));
  std::printf("[memory] dsv3 ep8: ring %lld rows for a 2 GB workspace\n", static_cast<long long>(ring));
  expect_refused([&] { return mok::ring_for_workspace(shape, cfg, 0, 132, int64_t(1e8)); }, "workspace_budget",
                 "a 100 MB workspace at DeepSeek-V3");
  const auto tiny = mok::LayerShape::uniform(1, 64, 128, 64, 8, 2);
  EXPECT_EQ(mok::ring_for_workspace(tiny, cfg, 0, 132, int64_t(1e9)), 0);
}

// Config::workspace_budget_bytes: the training mode in one setting — the ring resolves to
// ring_for_workspace's, so the plan is the one of that explicit ring; without a ring to choose the
// worst case stays; it needs share_workspace and the megakernel, and leaves the ring to itself.
TEST(MemoryPlan, WorkspaceBudgetResolvesTheRing) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  mok::Config budget = resident_config();
  budget.share_workspace = true;
  budget.workspace_budget_bytes = int64_t(2e9);
  const int64_t ring = mok::ring_for_workspace(shape, resident_config(), 0, 132, int64_t(2e9));
  EXPECT_EQ(budget.resolved_macrobatch(shape, 132), ring);
  mok::Config explicit_ring = resident_config();
  explicit_ring.share_workspace = true;
  explicit_ring.macrobatch_tokens = ring;
  const mok::MemoryPlan a = mok::plan_memory(shape, budget, 0, 132), b = mok::plan_memory(shape, explicit_ring, 0, 132);
  EXPECT_EQ(a.workspace(), b.workspace());
  EXPECT_EQ(a.total(mok::MemoryScope::Saved), b.total(mok::MemoryScope::Saved));
  EXPECT_EQ(a.backward_mode(), b.backward_mode());
  const auto tiny = mok::LayerShape::uniform(1, 64, 128, 64, 8, 2);
  EXPECT_EQ(budget.resolved_macrobatch(tiny, 132), resident_config().resolved_macrobatch(tiny, 132));
  mok::Config unshared = budget;
  unshared.share_workspace = false;
  expect_refused([&] { return mok::plan_memory(shape, unshared, 0, 132); }, "config.workspace_budget_bytes",
                 "a budget without share_workspace");
  mok::Config with_ring = budget;
  with_ring.macrobatch_tokens = ring;
  expect_refused([&] { return mok::plan_memory(shape, with_ring, 0, 132); }, "config.workspace_budget_bytes",
                 "a budget and a ring");
  mok::Config unfused = budget;
  unfused.forward_path = mok::ForwardPath::Unfused;
  expect_refused([&] { return mok::plan_memory(shape, unfused, 0, 132); }, "config.workspace_budget_bytes",
                 "a budget on the unfused path");
  mok::Config negative;
  negative.workspace_budget_bytes = -2;
  expect_refused([&] { return mok::plan_memory(shape, negative, 0, 132); }, "config.workspace_budget_bytes",
                 "a negative budget");
  budget.workspace_budget_bytes = int64_t(1e8);  // the smallest ring's workspace is larger
  expect_refused([&] { return mok::plan_memory(shape, budget, 0, 132); }, "workspace_budget", "a 100 MB budget");
  // Ranks with different token counts (a shared expert: its rows are in each rank's workspace):
  // the ring fits the largest workspace, i.e. it is the smallest of the ranks' own rings.
  const mok::LayerShape uneven{{1024, 8192}, 7168, 2048, 32, 8, 8192};
  const mok::Config plain = resident_config();
  const int64_t r0 = mok::ring_for_workspace(uneven, plain, 0, 132, int64_t(2e9)),
                r1 = mok::ring_for_workspace(uneven, plain, 1, 132, int64_t(2e9));
  EXPECT_GT(r0, r1) << "rank 1's shared-expert rows take room from its ring";
  EXPECT_EQ(mok::ring_for_workspace(uneven, plain, -1, 132, int64_t(2e9)), std::min(r0, r1));
}

// Config::saved_forwards = N: the saved state of N forwards (each slot's schedule, gate/up rows of
// the activation budget, shared-expert activations and routing copy), named by slot_name; more
// than one needs the backward over windows (a ring below the worst case) and pull dispatch.
TEST(MemoryPlan, SavedForwardsHoldOneSavedStateEach) {
  const auto shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8, 2048);
  mok::Config cfg = training_config();
  const mok::MemoryPlan one = mok::plan_memory(shape, cfg, 0, 132);
  cfg.saved_forwards = 3;
  const mok::MemoryPlan three = mok::plan_memory(shape, cfg, 0, 132);
  EXPECT_EQ(mok::slot_name("gu_saved", 0), "gu_saved");
  EXPECT_EQ(mok::slot_name("gu_saved", 2), "gu_saved#2");
  EXPECT_EQ(mok::slot_name("routing", 0, true), "routing#0");
  for (const char* base : {"gu_saved", "gu_s", "h_s", "schedule"})
    for (int i = 1; i < 3; ++i) EXPECT_EQ(three.bytes(mok::slot_name(base, i)), one.bytes(base)) << base << " " << i;
  EXPECT_EQ(three.bytes(mok::slot_name("routing", 2, true)), 8192 * 8 * 4);
  // Every saved buffer thrice but the routing window, which becomes the next forward's (each slot
  // keeps a copy of its own routing instead).
  EXPECT_EQ(three.total(mok::MemoryScope::Saved),
            3 * (one.total(mok::MemoryScope::Saved) - one.bytes("window.routing")) + 3 * 8192 * 8 * 4);
  EXPECT_EQ(three.workspace(), one.workspace());
  const auto refused = [&](const mok::LayerShape& sh, const mok::Config& c, const char* why) {
    expect_refused([&] { return mok::plan_memory(sh, c, 0, 132); }, "config.saved_forwards", why);
  };
  mok::Config resident = resident_config();  // the default ring holds the worst case at EP 1
  resident.saved_forwards = 2;
  refused(mok::LayerShape::uniform(1, 8192, 7168, 2048, 256, 8), resident, "saved_forwards with a resident backward");
  mok::Config push = cfg;
  push.dispatch = mok::DispatchPath::Push;
  refused(shape, push, "saved_forwards with push dispatch");
  mok::Config zero = cfg;
  zero.saved_forwards = 0;
  refused(shape, zero, "saved_forwards = 0");
}

namespace {

// FP8 (unfused forward): the weights' codes and 128 x 128 scales are the one buffer FP8 adds
// (x, h and the window hold codes and scales in the bf16 buffers' bytes); half the bf16 weights.
// On the unfused path FP8 trains: the bf16 layer's saved state but the x rows (gu; the FP8
// backward quantizes x from the windows, so x_routed holds the forward's codes only, Layer scope,
// in the shared workspace when there is one) and backward buffers, plus the FP8 backward's
// operands (fp8_backward_layout.h), Backward scope. The FP8
// megakernel is forward only: nothing kept for a backward, no backward buffers.
TEST(MemoryPlan, Fp8AddsTheWeightCodesAndTheBackwardOperands) {
  const mok::LayerShape shape = mok::LayerShape::uniform(1, 8192, 7168, 2048, 32, 8, 0);
  mok::Config bf16 = resident_config();
  bf16.forward_path = mok::ForwardPath::Unfused;
  mok::Config fp8 = bf16;
  fp8.precision = mok::Precision::FP8;
  const mok::MemoryPlan a = mok::plan_memory(shape, bf16, 0, 132), b = mok::plan_memory(shape, fp8, 0, 132);
  EXPECT_FALSE(a.has("fp8_weights"));
  ASSERT_TRUE(b.has("fp8_weights"));
  const int64_t codes = 3 * 32 * 2048 * 7168, scales = 3 * 32 * (2048 / 128) * (7168 / 128) * 4;
  EXPECT_EQ(b.bytes("fp8_weights"), codes + scales);
  ASSERT_TRUE(a.has("gu"));
  ASSERT_TRUE(b.has("gu"));
  EXPECT_EQ(a.bytes("gu"), b.bytes("gu"));
  const int64_t cap = shape.worst_case_rows(), H = 7168, I = 2048;
  const int64_t x_bf16 = cap * H * 2, x_fp8 = cap * H + cap * (H / 128) * 4;
  EXPECT_EQ(a.bytes("x_routed"), x_bf16);
  EXPECT_EQ(b.bytes("x_routed"), x_fp8);
  EXPECT_EQ(a.total(mok::MemoryScope::Saved) - x_bf16, b.total(mok::MemoryScope::Saved));
  EXPECT_STREQ(b.backward_mode(), "resident");
  // The backward's operands: the token blocks of d_y, [d_g d_u] and w h, and one region used in
  // turn (d_y's rows, [d_g d_u]'s, x^T): 2H + 3I codes per row while H >= 2I.
  const int64_t rows_codes = cap * (2 * H + 3 * I), weight_codes = 3 * 32 * I * H;
  ASSERT_TRUE(b.has("fp8_bwd_rows") && b.has("fp8_bwd_weights"));
  EXPECT_GE(b.bytes("fp8_bwd_rows"), rows_codes * 33 / 32);  // + fp32 scales per 128
  EXPECT_LE(b.bytes("fp8_bwd_rows"), rows_codes * 33 / 32 + 16 * 1024);
  EXPECT_GE(b.bytes("fp8_bwd_weights"), weight_codes + scales);
  EXPECT_LE(b.bytes("fp8_bwd_weights"), weight_codes + scales + 8 * 1024);
  // (d_y pulled as codes made at its source: no routed bf16 copy of d_out's rows)
  ASSERT_TRUE(a.has("dy_rows"));
  EXPECT_FALSE(b.has("dy_rows"));
  EXPECT_EQ(b.total(mok::MemoryScope::Backward) - a.total(mok::MemoryScope::Backward),
            b.bytes("fp8_bwd_rows") + b.bytes("fp8_bwd_weights") - a.bytes("dy_rows"));
  // d_y at its source: the d_out window also holds the rows' 1 x 128 codes and scales.
  const int64_t dout_codes = 8192 * H + 8192 * (H / 128) * 4;
  EXPECT_EQ(b.bytes("window.d_out") - a.bytes("window.d_out"), dout_codes);
  EXPECT_EQ(b.total() - a.total(),
            codes + scales + b.bytes("fp8_bwd_rows") + b.bytes("fp8_bwd_weights") + x_fp8 - x_bf16 + dout_codes -
                a.bytes("dy_rows"));
  // With a shared workspace the backward's operands are one copy for every layer.
  mok::Config fp8_ws = fp8;
  fp8_ws.share_workspace = true;
  const mok::MemoryPlan w = mok::plan_memory(shape, fp8_ws, 0, 132);
  for (const auto& buf : w.buffers) {
    if (buf.name == "fp8_bwd_rows" || buf.name == "fp8_bwd_weights" || buf.name == "x_routed") {
      EXPECT_TRUE(buf.workspace) << buf.name;
    }
  }
  // Config::fp8_keep_weight_codes_t: the backward's weight codes are the layer's own (made with the
  // forward's), the same bytes; refused by name where there is no FP8 backward to keep them for.
  mok::Config kept = fp8_ws;
  kept.fp8_keep_weight_codes_t = true;
  const mok::MemoryPlan k = mok::plan_memory(shape, kept, 0, 132);
  for (const auto& buf : k.buffers) {
    if (buf.name == "fp8_bwd_weights") {
      EXPECT_FALSE(buf.workspace);
      EXPECT_EQ(buf.scope, mok::MemoryScope::Layer);
      EXPECT_EQ(buf.bytes, b.bytes("fp8_bwd_weights"));
    }
  }
  EXPECT_EQ(k.total(mok::MemoryScope::Layer) - w.total(mok::MemoryScope::Layer), b.bytes("fp8_bwd_weights"));
  for (const bool megakernel : {false, true}) {
    mok::Config bad = megakernel ? fp8 : bf16;
    if (megakernel) bad.forward_path = mok::ForwardPath::Megakernel;
    bad.fp8_keep_weight_codes_t = true;
    EXPECT_THROW(
        {
          try {
            bad.validate(shape, 132);
          } catch (const mok::Error& e) {
            EXPECT_NE(std::string(e.what()).find("config.fp8_keep_weight_codes_t"), std::string::npos) << e.what();
            throw;
          }
        },
        mok::Error);
  }
  // The FP8 megakernel: forward only.
  mok::Config fp8_mk = fp8;
  fp8_mk.forward_path = mok::ForwardPath::Megakernel;
  const mok::MemoryPlan m = mok::plan_memory(shape, fp8_mk, 0, 132);
  EXPECT_FALSE(m.has("gu"));
  EXPECT_FALSE(m.has("dy_rows"));
  EXPECT_FALSE(m.has("fp8_bwd_rows"));
  EXPECT_EQ(m.total(mok::MemoryScope::Backward), 0);
  EXPECT_EQ(m.total(mok::MemoryScope::Saved), 0);
  EXPECT_STREQ(m.backward_mode(), "none");
  mok::Config fp8_slots = fp8_mk;
  fp8_slots.saved_forwards = 2;  // nothing to save: refused by name
  EXPECT_THROW(
      {
        try {
          fp8_slots.validate(shape, 132);
        } catch (const mok::Error& e) {
          EXPECT_NE(std::string(e.what()).find("config.saved_forwards"), std::string::npos) << e.what();
          throw;
        }
      },
      mok::Error);
  // MXFP8 runs on the FP8 buffers (its codes re-blocked to the same blocks): the same plan, buffer
  // by buffer, on both paths (and with the kept weight codes), but for the d_out window: recipe 1's
  // training path makes d_y's codes at their source there (MXFP8 quantizes a routed copy).
  for (const bool megakernel : {false, true})
    for (const bool keep : {false, true}) {
      if (megakernel && keep) continue;  // (kept codes: the unfused path's; refused otherwise)
      mok::Config f = megakernel ? fp8_mk : fp8;
      f.fp8_keep_weight_codes_t = keep;
      mok::Config mx = f;
      mx.precision = mok::Precision::MXFP8;
      const mok::MemoryPlan pf = mok::plan_memory(shape, f, 0, 132);
      mok::MemoryPlan pm = mok::plan_memory(shape, mx, 0, 132);
      if (!megakernel) {  // (MXFP8's routed d_y copy)
        ASSERT_TRUE(pm.has("dy_rows") && !pf.has("dy_rows"));
        std::erase_if(pm.buffers, [](const mok::BufferBytes& x) { return x.name == "dy_rows"; });
      }
      ASSERT_EQ(pf.buffers.size(), pm.buffers.size()) << "megakernel " << megakernel << ", keep " << keep;
      for (size_t i = 0; i < pf.buffers.size(); ++i) {
        EXPECT_EQ(pf.buffers[i].name, pm.buffers[i].name);
        const bool dout = pf.buffers[i].name == "window.d_out" && !megakernel;
        EXPECT_EQ(pf.buffers[i].bytes - (dout ? 8192 * H + 8192 * (H / 128) * 4 : 0), pm.buffers[i].bytes)
            << pf.buffers[i].name;
        EXPECT_EQ(pf.buffers[i].scope, pm.buffers[i].scope) << pf.buffers[i].name;
      }
      EXPECT_STREQ(pf.backward_mode(), pm.backward_mode());
    }
  std::printf("[memory fp8] DeepSeek-V3 EP-8 slice: fp8 weights %.2f GB per layer (bf16 weights %.2f GB); the "
              "backward's operands %.2f GB rows + %.2f GB weight codes (Backward scope: shared by all layers with "
              "a workspace); the layer %.2f GB (bf16 %.2f GB)\n",
              double(codes + scales) / 1e9, 2.0 * double(codes) / 1e9, double(b.bytes("fp8_bwd_rows")) / 1e9,
              double(b.bytes("fp8_bwd_weights")) / 1e9, double(b.total()) / 1e9, double(a.total()) / 1e9);
}

// FP8 trains on the megakernel with a ring below the worst case (the backward over windows, as
// bf16's: the activation budget's gate/up rows saved by the forward, FC1 again in FP8 past it):
// the default config (a 2 GB shared workspace) at DeepSeek-V3 EP 8, T = 8192, for fp8 and mxfp8.
// Saved per forward: the routing, the schedule and the budget's gate/up rows (bf16's); the
// per-layer rest is the forward's weight codes; the backward's buffers hold one window (gu, dy
// rows, fp8_bwd_rows for the ring's rows) in the workspace, with the per-call weight codes. With
// no budget (full recompute) nothing but the routing and schedule is saved. Against the resident
// unfused FP8 plan, which holds the worst case.
TEST(MemoryPlan, Fp8TrainsOverWindowsOfTheRing) {
  const mok::LayerShape shape = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8, 0);
  for (const auto prec : {mok::Precision::FP8, mok::Precision::MXFP8}) {
    mok::Config cfg;  // the training default: share_workspace, the automatic 2 GB budget
    cfg.precision = prec;
    const mok::MemoryPlan p = mok::plan_memory(shape, cfg, 0, 132);
    EXPECT_STREQ(p.backward_mode(), "saved") << mok::to_string(prec);
    const int64_t R = cfg.resolved_macrobatch(shape, 132);
    ASSERT_LT(R, shape.worst_case_rows());
    EXPECT_EQ(p.bytes("gu"), R * 4 * 2048);
    mok::Config bf16;
    EXPECT_EQ(p.bytes("gu_saved"), mok::plan_memory(shape, bf16, 0, 132).bytes("gu_saved"));
    EXPECT_EQ(p.bytes("gu_saved"), cfg.resolved_saved_rows(shape) * 4 * 2048);
    mok::Config none = cfg;
    none.activation_budget_bytes = 0;
    const mok::MemoryPlan r = mok::plan_memory(shape, none, 0, 132);
    EXPECT_STREQ(r.backward_mode(), "recompute");
    EXPECT_FALSE(r.has("gu_saved"));
    EXPECT_LT(r.total(mok::MemoryScope::Saved), 16 << 20);
    EXPECT_TRUE(p.has("bwd_carry") && p.has("bwd_windows") && p.has("dy_rows"));
    EXPECT_EQ(p.bytes("fp8_bwd_rows"), mok::fp8_bwd::rows_layout(R, 7168, 2048).bytes);
    for (const auto& b : p.buffers) {
      if (b.name == "gu" || b.name == "dy_rows" || b.name == "fp8_bwd_rows" || b.name == "fp8_bwd_weights" ||
          b.name == "bwd_carry" || b.name == "x_ring") {
        EXPECT_TRUE(b.workspace) << b.name;
      }
    }
    // What a layer holds alone (not in the workspace): the forward's weight codes (Layer) and,
    // saved, the routing, the schedule (~4 MB at EP 8) and the budget's gate/up rows.
    const auto own = [](const mok::MemoryPlan& m) {
      int64_t b = 0;
      for (const auto& x : m.buffers) b += x.workspace ? 0 : x.bytes;
      return b;
    };
    EXPECT_EQ(own(p), p.bytes("fp8_weights") + p.total(mok::MemoryScope::Saved) + p.bytes("counters") +
                          p.bytes("peer_tables"));
    EXPECT_EQ(p.total(mok::MemoryScope::Saved) - p.bytes("gu_saved"), r.total(mok::MemoryScope::Saved));
    // The automatic budget: 2 GB plus the backward's per-call weight codes (no ring holds fewer),
    // so the FP8 ring is not the smallest one (the fallback when nothing fits).
    const int64_t budget = mok::default_workspace_budget(shape, cfg);
    EXPECT_EQ(budget, 2000000000 + p.bytes("fp8_bwd_weights"));
    EXPECT_LE(p.workspace(), budget);
    EXPECT_GT(R, 2 * cfg.resolved_minibatch(shape, 132));
    mok::Config unfused = cfg;
    unfused.forward_path = mok::ForwardPath::Unfused;
    const mok::MemoryPlan u = mok::plan_memory(shape, unfused, 0, 132);
    EXPECT_GT(own(u) + u.workspace(), 5 * (own(p) + p.workspace()));
    std::printf("[memory fp8 windows] %s DeepSeek-V3 EP 8 T 8192: ring %lld rows of %lld (bf16: %lld); per layer %.3f GB "
                "(fp8 weight codes %.3f, saved %.4f; full recompute %.3f GB, saved %.4f), workspace %.3f GB (the "
                "backward's weight codes %.3f); the unfused resident fp8 plan: per layer %.3f GB (saved %.3f), "
                "workspace %.3f GB\n",
                mok::to_string(prec), (long long)R, (long long)shape.worst_case_rows(),
                (long long)mok::Config{}.resolved_macrobatch(shape, 132), double(own(p)) * 1e-9,
                double(p.bytes("fp8_weights")) * 1e-9, double(p.total(mok::MemoryScope::Saved)) * 1e-9,
                double(own(r)) * 1e-9, double(r.total(mok::MemoryScope::Saved)) * 1e-9,
                double(p.workspace()) * 1e-9, double(p.bytes("fp8_bwd_weights")) * 1e-9, double(own(u)) * 1e-9,
                double(u.total(mok::MemoryScope::Saved)) * 1e-9, double(u.workspace()) * 1e-9);
  }
}

}  // namespace
