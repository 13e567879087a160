// The forward megakernel's host plan (src/megakernel/forward_setup.h): with the target parts'
// 132 SMs it resolves every knob to what the layer computed inline before (so the megakernel's
// bits and timings cannot change on H100/H200 SXM), the device's real SM count changes the
// minibatch where the two-wave rule binds, and settings that cannot run are named.
#include <gtest/gtest.h>

#include <string>

#include "megakernel/forward_setup.h"
#include "mok/errors.hpp"
#include "schedule/schedule_math.h"

namespace {

using mok::LayerShape;
using mok::mk::plan_forward;

struct ModelCase {
  const char* name;
  int world;
  int64_t T, H, I, E, k, Is;
};

const ModelCase kModels[] = {
    {"dsv3_ep1", 1, 8192, 7168, 2048, 256, 8, 0},   {"dsv3_ep8_slice", 1, 8192, 7168, 2048, 32, 8, 0},
    {"dsv3_ep2", 2, 8192, 7168, 2048, 256, 8, 2048}, {"qwen3_235b_ep8", 8, 8192, 4096, 1536, 128, 8, 0},
    {"qwen3_30b_ep1", 1, 2048, 2048, 768, 128, 8, 0}, {"small_shared", 2, 700, 1024, 512, 16, 4, 512},
};

TEST(ForwardSetup, At132SmsItIsWhatTheConfigResolves) {
  for (const ModelCase& m : kModels) {
    for (const bool clusters : {false, true}) {
      const LayerShape shape = LayerShape::uniform(m.world, m.T, m.H, m.I, m.E, m.k, m.Is);
      mok::Config cfg;
      cfg.fwd_clusters = clusters;
      const auto s = plan_forward(shape, cfg, 0, 132);
      const int64_t mb = cfg.resolved_minibatch(shape), ring = cfg.resolved_macrobatch(shape);
      const int64_t cap = shape.worst_case_rows();
      SCOPED_TRACE(std::string(m.name) + (clusters ? " clusters" : ""));
      EXPECT_EQ(s.plan.mb_rows, mb);
      EXPECT_EQ(s.ring_rows, std::max<int64_t>(128, std::min(ring, mok::sched::round_up(cap, mb))));
      EXPECT_EQ(s.plan.ring_rows, s.ring_rows);
      EXPECT_EQ(s.plan.n1, mok::sched::ceil_div(2 * m.I, 256));
      EXPECT_EQ(s.plan.n2, mok::sched::ceil_div(m.H, 256));
      EXPECT_EQ(s.plan.s_tiles, m.Is > 0 ? mok::sched::ceil_div(m.T, 128) : 0);
      EXPECT_EQ(s.plan.comm_ctas, cfg.resolved_fwd_comm_sms(shape));
      EXPECT_EQ(s.plan.pair, clusters ? 1 : 0);
      EXPECT_EQ(s.plan.group_m, clusters ? 4 : 8);
      EXPECT_EQ(s.layout.max_positions, mok::sched::ceil_div(cap, mb));
      EXPECT_EQ(s.layout.max_tiles, cap / 128);
      EXPECT_GE(s.widest.words(), s.layout.words());
      // sm_count 0 means the same default.
      EXPECT_EQ(plan_forward(shape, cfg, 0, 0).plan.mb_rows, s.plan.mb_rows);
    }
  }
}

TEST(ForwardSetup, TheDevicesSmCountSetsTheTwoWaveMinibatch) {
  // DeepSeek-V3 at EP 8, T = 8192: the two-wave rule binds (the routes per rank are plenty).
  const LayerShape shape = LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  const mok::Config cfg;
  const auto h200 = plan_forward(shape, cfg, 0, 132), h100_pcie = plan_forward(shape, cfg, 0, 114);
  EXPECT_LT(h100_pcie.plan.mb_rows, h200.plan.mb_rows);
  EXPECT_EQ(h100_pcie.plan.mb_rows % 128, 0);
  EXPECT_EQ(h100_pcie.plan.mb_rows, cfg.resolved_minibatch(shape, 114));
  EXPECT_EQ(h100_pcie.plan.ring_rows % h100_pcie.plan.mb_rows, 0);
}

TEST(ForwardSetup, WhatCannotRunIsNamed) {
  const LayerShape shape = LayerShape::uniform(1, 700, 1024, 512, 16, 4, 512);
  mok::Config small_ring;
  small_ring.minibatch_tokens = 256;
  small_ring.macrobatch_tokens = 256;  // one minibatch, below the worst case
  try {
    (void)plan_forward(shape, small_ring, 0, 132);
    ADD_FAILURE() << "a ring of one minibatch was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "config.macrobatch_tokens") << e.what();
  }
  mok::Config too_many_comm;
  too_many_comm.fwd_comm_sms = 132;
  try {
    (void)plan_forward(shape, too_many_comm, 0, 132);
    ADD_FAILURE() << "no compute SM left was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "config.fwd_comm_sms") << e.what();
  }
}

}  // namespace

namespace {

// The ring is checked with the SM count the layer runs with (a review found the check used 132
// SMs while the layer used the device's: on 114 SMs a 4096-row ring passed with a 1792-row
// minibatch, leaving 512 rows of every macrobatch without a position).
TEST(ForwardSetup, TheRingIsCheckedWithTheDevicesMinibatch) {
  const LayerShape shape = LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  mok::Config cfg;
  const int64_t mb114 = cfg.resolved_minibatch(shape, 114), mb132 = cfg.resolved_minibatch(shape, 132);
  ASSERT_NE(mb114, mb132);
  ASSERT_NE(mb132 % mb114, 0);
  cfg.macrobatch_tokens = 2 * mb132;
  EXPECT_NO_THROW((void)plan_forward(shape, cfg, 0, 132));
  try {
    (void)plan_forward(shape, cfg, 0, 114);
    ADD_FAILURE() << "a ring of 2 x " << mb132 << " rows was accepted with a minibatch of " << mb114;
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "config.macrobatch_tokens") << e.what();
  }
  cfg.macrobatch_tokens = 2 * mb114;
  const auto s = plan_forward(shape, cfg, 0, 114);
  EXPECT_EQ(s.plan.ring_rows % s.plan.mb_rows, 0);
}

}  // namespace
