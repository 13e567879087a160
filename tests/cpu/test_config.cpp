// Shape and config validation: each violated constraint gives an error naming the argument.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "common/env_flag.h"
#include "mok/config.hpp"
#include "mok/errors.hpp"

namespace {

mok::LayerShape good() { return mok::LayerShape::uniform(2, 256, 512, 256, 16, 4, 256); }

// Runs fn, expects a mok::Error whose argument is `arg` and whose message contains `needle`.
void expect_error(const std::function<void()>& fn, const std::string& arg, const std::string& needle,
                  mok::ErrorKind kind = mok::ErrorKind::InvalidArgument) {
  try {
    fn();
    FAIL() << "expected an error about " << arg;
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.kind(), kind);
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(ShapeValidation, GoodShapePasses) { EXPECT_NO_THROW(good().validate()); }

TEST(ShapeValidation, TopKZero) {
  auto s = good();
  s.top_k = 0;
  expect_error([&] { s.validate(); }, "shape.top_k", "k must be >= 1");
}

TEST(ShapeValidation, TopKAboveExperts) {
  auto s = good();
  s.top_k = 17;
  expect_error([&] { s.validate(); }, "shape.top_k", "k must be <= E");
}

TEST(ShapeValidation, ExpertsNotDivisibleByWorld) {
  auto s = mok::LayerShape::uniform(4, 256, 512, 256, 18, 4);
  expect_error([&] { s.validate(); }, "shape.experts", "divisible by the EP world size");
}

TEST(ShapeValidation, HiddenNotMultipleOf64) {
  auto s = good();
  s.hidden = 500;
  expect_error([&] { s.validate(); }, "shape.hidden", "multiple of 64");
}

TEST(ShapeValidation, IntermediateNotMultipleOf64) {
  auto s = good();
  s.intermediate = 96;
  expect_error([&] { s.validate(); }, "shape.intermediate", "multiple of 64");
}

TEST(ShapeValidation, SharedIntermediateNotMultipleOf64) {
  auto s = good();
  s.shared_intermediate = 100;
  expect_error([&] { s.validate(); }, "shape.shared_intermediate", "multiple of 64");
}

TEST(ShapeValidation, NegativeTokens) {
  auto s = good();
  s.tokens[1] = -5;
  expect_error([&] { s.validate(); }, "shape.tokens", "rank 1 has -5");
}

TEST(ShapeValidation, NoRanks) {
  mok::LayerShape s = good();
  s.tokens.clear();
  expect_error([&] { s.validate(); }, "shape.tokens", "world size >= 1");
}

TEST(ShapeValidation, ZeroTokensOnARankIsValid) {
  auto s = good();
  s.tokens[0] = 0;
  EXPECT_NO_THROW(s.validate());
}

TEST(ShapeValidation, CombineBufferOverflowsInt32) {
  // T*k*H = 70000 * 8 * 4096 > 2^31.
  auto s = mok::LayerShape::uniform(2, 70000, 4096, 1536, 128, 8);
  expect_error([&] { s.validate(); }, "shape.tokens", "fit 32-bit indexing");
}

TEST(ShapeValidation, DeepSeekShapesAreValid) {
  for (int W : {1, 2, 4, 8})
    for (int64_t T : {2048, 8192})
      EXPECT_NO_THROW(mok::LayerShape::uniform(W, T, 7168, 2048, 256, 8).validate());
}

TEST(ConfigValidation, DefaultsResolve) {
  const auto s = good();
  mok::Config c;
  EXPECT_NO_THROW(c.validate(s, 132));
  EXPECT_EQ(c.resolved_minibatch(s) % 128, 0);
  EXPECT_EQ(c.resolved_macrobatch(s) % c.resolved_minibatch(s), 0);
  EXPECT_GE(c.resolved_macrobatch(s), s.worst_case_rows());
}

TEST(ConfigValidation, MinibatchFollowsTwoWaveRule) {
  // DeepSeek-V3 with 16 comm SMs, 116 compute SMs: >= 2*116*128*256/4096 = 1856 rows -> 1920.
  const auto s = mok::LayerShape::uniform(2, 8192, 7168, 2048, 256, 8);
  mok::Config c;
  c.fwd_comm_sms = 16;
  EXPECT_EQ(c.resolved_minibatch(s), 1920);
  // Shape-chosen comm SMs (8 for I = 2048): 124 compute SMs -> 1984 -> 2048.
  c.fwd_comm_sms = 0;
  EXPECT_EQ(c.resolved_fwd_comm_sms(s), 8);
  EXPECT_EQ(c.resolved_minibatch(s), 2048);
  // Few routed rows per rank (T = 2048: 16384): 1/16 of them, but at least one wave (992 -> 1024).
  EXPECT_EQ(c.resolved_minibatch(mok::LayerShape::uniform(2, 2048, 7168, 2048, 256, 8)), 1024);
  EXPECT_EQ(c.resolved_minibatch(mok::LayerShape::uniform(2, 64, 7168, 2048, 256, 8)), 1024);
}

TEST(ConfigValidation, CommSmsFromTheShape) {
  mok::Config c;
  const auto sms = [&](int64_t H, int64_t I) {
    return c.resolved_fwd_comm_sms(mok::LayerShape::uniform(2, 8192, H, I, 128, 8));
  };
  EXPECT_EQ(sms(7168, 2048), 8);   // DeepSeek-V3
  EXPECT_EQ(sms(4096, 1536), 12);  // Qwen3-235B
  EXPECT_EQ(sms(2048, 768), 24);   // Qwen3-30B-A3B
  EXPECT_EQ(sms(1024, 128), 32);   // clamped
  EXPECT_EQ(sms(8192, 8192), 4);   // clamped
  c.fwd_comm_sms = 20;
  EXPECT_EQ(sms(7168, 2048), 20);  // explicit value wins
  // The megakernel on one GPU (local copies): at most 16; the shapes below 16 keep their value.
  c.fwd_comm_sms = 0;
  const auto one = [&](int64_t H, int64_t I) {
    return c.resolved_fwd_comm_sms(mok::LayerShape::uniform(1, 8192, H, I, 128, 8));
  };
  EXPECT_EQ(one(2048, 768), 16);   // Qwen3-30B-A3B (24 at EP > 1)
  EXPECT_EQ(one(4096, 1536), 12);  // Qwen3-235B
  EXPECT_EQ(one(7168, 2048), 8);   // DeepSeek-V3
  EXPECT_EQ(one(1024, 128), 16);
  // The unfused path's movement kernels run alone: the rule's grid.
  c.forward_path = mok::ForwardPath::Unfused;
  EXPECT_EQ(one(2048, 768), 24);
}

TEST(ConfigValidation, MinibatchNotMultipleOf128) {
  mok::Config c;
  c.minibatch_tokens = 1000;
  expect_error([&] { c.validate(good()); }, "config.minibatch_tokens", "multiple of 128");
}

TEST(ConfigValidation, MacrobatchNotMultipleOfMinibatch) {
  mok::Config c;
  c.minibatch_tokens = 256;
  c.macrobatch_tokens = 384;
  expect_error([&] { c.validate(good()); }, "config.macrobatch_tokens", "multiple of the minibatch");
}

TEST(ConfigValidation, CommSmsLeaveNoComputeSm) {
  mok::Config c;
  c.fwd_comm_sms = 132;
  expect_error([&] { c.validate(good(), 132); }, "config.fwd_comm_sms", "at least one compute SM");
  c.fwd_comm_sms = 16;
  c.bwd_comm_sms = 0;
  expect_error([&] { c.validate(good(), 132); }, "config.bwd_comm_sms", "must be >= 1");
}

TEST(ConfigValidation, ClustersNeedAnEvenCommSmCount) {
  mok::Config c;
  c.fwd_clusters = true;
  EXPECT_NO_THROW(c.validate(good(), 132));  // the shape's choice is a multiple of 4
  c.fwd_comm_sms = 7;
  expect_error([&] { c.validate(good(), 132); }, "config.fwd_comm_sms", "must be even");
  c.fwd_clusters = false;
  EXPECT_NO_THROW(c.validate(good(), 132));
}

TEST(ConfigValidation, WaitTimeoutMustBePositive) {
  mok::Config c;
  c.wait_timeout_s = 0;
  expect_error([&] { c.validate(good()); }, "config.wait_timeout_s", "(0, 3600]");
}

TEST(ConfigValidation, Fp8AndMxFp8AreTheReferencesForwardOnly) {
  mok::Config c;
  for (const auto p : {mok::Precision::FP8, mok::Precision::MXFP8}) {
    c.precision = p;
    EXPECT_NO_THROW(c.validate(good()));  // the CPU reference's forward (the GPU layer refuses it by name)
  }
}

TEST(ConfigValidation, RingTooLargeFor32BitOffsets) {
  const auto s = mok::LayerShape::uniform(8, 8192, 7168, 2048, 256, 8);
  mok::Config c;
  c.minibatch_tokens = 2048;
  c.macrobatch_tokens = 2048 * 200;  // 409600 rows * 7168 > 2^31
  expect_error([&] { c.validate(s); }, "config.macrobatch_tokens", "fit 32-bit indexing");
  c.macrobatch_tokens = 0;  // automatic: clamps to the 32-bit limit
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_LT(c.resolved_macrobatch(s) * 7168, int64_t{1} << 31);
}

// The layer's A/B knobs (MOK_BWD_*): 0 / 1, the fallback when unset, anything else refused by name.
TEST(EnvFlag, ZeroOneFallbackAndNamedRefusal) {
  const char* name = "MOK_TEST_ENV_FLAG";
  unsetenv(name);
  EXPECT_TRUE(mok::env_flag(name, true));
  EXPECT_FALSE(mok::env_flag(name, false));
  setenv(name, "0", 1);
  EXPECT_FALSE(mok::env_flag(name, true));
  setenv(name, "1", 1);
  EXPECT_TRUE(mok::env_flag(name, false));
  setenv(name, "yes", 1);
  expect_error([&] { mok::env_flag(name, true); }, name, "must be 0 or 1, got 'yes'");
  unsetenv(name);
}
