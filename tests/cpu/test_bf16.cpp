#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "mok/bf16.hpp"

using mok::bf16;

TEST(Bf16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 3.140625f, 65536.0f, 1e-30f})
    EXPECT_EQ(float(bf16(float(bf16(f)))), float(bf16(f)));
  EXPECT_EQ(float(bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16(-0.0f).bits, 0x8000);
}

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float(bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(float(bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  // Just above the halfway point rounds up.
  EXPECT_EQ(float(bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));
}

TEST(Bf16, SpecialValues) {
  EXPECT_TRUE(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(float(bf16(-std::numeric_limits<float>::signaling_NaN()))));
  EXPECT_EQ(float(bf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  // The largest float rounds up to infinity (as __float2bfloat16_rn does).
  EXPECT_EQ(float(bf16(std::numeric_limits<float>::max())), std::numeric_limits<float>::infinity());
  // Subnormals are kept, not flushed.
  EXPECT_GT(float(bf16(std::numeric_limits<float>::denorm_min() * 65536.0f)), 0.0f);
}
