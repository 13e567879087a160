// Block-scaled FP8 as the DeepSeek-V3 recipe uses it (1x128 activation blocks, 128x128 weight
// tiles, fp32 or power-of-two scales): src/reference/fp8_quant.* against fp8_test_reference.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/fp8_format.h"
#include "fp8_test_reference.h"
#include "mok/errors.hpp"
#include "reference/fp8_quant.h"

namespace fp8 = mok::fp8;
using namespace fp8_test;

// ---- Block-scaled FP8 (DeepSeek-V3 recipe) ------------------------------------------------------

namespace {

// The scale by the recipe's definition, computed independently of the implementation where the
// rule allows (Pow2: the smallest power of two with amax <= 448 s, found by exact search).
float expected_block_scale(float amax, fp8::ScaleRule rule) {
  if (amax == 0.0f) return 1.0f;
  if (rule == fp8::ScaleRule::Fp32) return std::max(amax / 448.0f, 0x1p-126f);
  int e = 0;
  std::frexp(static_cast<double>(amax) / 448.0, &e);
  while (std::ldexp(448.0, e) < amax) ++e;
  while (std::ldexp(448.0, e - 1) >= amax) --e;
  return std::ldexp(1.0f, std::clamp(e, -126, 119));  // 2^120 could dequantize to Inf
}

struct BlockedResult {
  std::vector<uint8_t> q;
  std::vector<float> scales, out;
};

BlockedResult quantize_blocked(const std::vector<float>& in, int64_t rows, int64_t cols,
                               fp8::BlockShape block, fp8::ScaleRule rule) {
  BlockedResult r;
  r.q.resize(in.size());
  r.scales.resize(static_cast<size_t>(fp8::scale_count(rows, cols, block)));
  r.out.resize(in.size());
  fp8::quantize_blocked(in.data(), rows, cols, block, rule, r.q.data(), r.scales.data());
  fp8::dequantize_blocked(r.q.data(), r.scales.data(), rows, cols, block, r.out.data());
  return r;
}

// Scales, codes and dequantized values against the definition; error bounds per element (half
// an E4M3 step of v * (1 / s), 2^-4 relative, or 2^-10 s among the subnormals) and per block (2^-4 of
// the block maximum); zeros exact with their sign; for Fp32 the block maximum at ±448.
void expect_blocked_matches_spec(const std::vector<float>& in, int64_t rows, int64_t cols,
                                 fp8::BlockShape block, fp8::ScaleRule rule,
                                 const BlockedResult& res) {
  const int64_t n_blocks = fp8::scale_count(rows, cols, block);
  std::vector<float> amax(static_cast<size_t>(n_blocks), 0.0f);
  std::vector<char> finite(static_cast<size_t>(n_blocks), 1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t b = static_cast<size_t>(block_index(r, c, cols, block));
      const float v = in[static_cast<size_t>(r * cols + c)];
      if (!std::isfinite(v))
        finite[b] = 0;
      else
        amax[b] = std::max(amax[b], std::fabs(v));
    }
  int64_t bad = 0;
  auto fail = [&](int64_t r, int64_t c, const char* what) {
    if (++bad <= 10) ADD_FAILURE() << what << " at (" << r << ", " << c << ")";
  };
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float s = res.scales[static_cast<size_t>(b)];
    if (!finite[static_cast<size_t>(b)]) {
      if (!std::isnan(s)) fail(b, -1, "scale of a non-finite block is not NaN");
      continue;
    }
    if (bits_of(s) != bits_of(expected_block_scale(amax[static_cast<size_t>(b)], rule)))
      fail(b, -1, "block scale");
    if (rule == fp8::ScaleRule::Pow2 && fp8::e8m0_encode(s) == 0xff)
      fail(b, -1, "Pow2 scale is not a power of two");
  }
  std::vector<double> block_err(static_cast<size_t>(n_blocks), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const size_t b = static_cast<size_t>(block_index(r, c, cols, block));
      const float v = in[i], s = res.scales[b];
      if (!finite[b]) {
        if (res.q[i] != 0x7f || !std::isnan(res.out[i]))
          fail(r, c, "element of a non-finite block");
        continue;
      }
      if (res.q[i] != e4m3_reference(v * (1.0f / s))) fail(r, c, "element code");  // r = 1 / s per block
      const double deq = e4m3_value(res.q[i]) * static_cast<double>(s);  // exact in double
      if (bits_of(res.out[i]) != bits_of(static_cast<float>(deq))) fail(r, c, "dequantized value");
      const double err = std::fabs(static_cast<double>(res.out[i]) - static_cast<double>(v));
      // Beyond 448 s (only a Pow2 block above 448 * 2^119) an element saturates.
      const double av = std::fabs(static_cast<double>(v));
      const double bound = std::max({av / 16.0, 0x1p-10 * s, av - 448.0 * s});
      if (err > bound * (rule == fp8::ScaleRule::Pow2 ? 1.0 : 1.0 + 0x1p-16))
        fail(r, c, "element error beyond the bound");
      block_err[b] = std::max(block_err[b], err);
      if (v == 0.0f && bits_of(res.out[i]) != bits_of(v)) fail(r, c, "zero not kept exactly");
      const bool at_max = std::fabs(v) == amax[b] && amax[b] > 0.0f;
      if (rule == fp8::ScaleRule::Fp32 && at_max && amax[b] / 448.0f >= 0x1p-126f &&
          (res.q[i] & 0x7f) != 0x7e)
        fail(r, c, "block maximum not at 448");
    }
  for (int64_t b = 0; b < n_blocks; ++b)
    if (finite[static_cast<size_t>(b)] && amax[static_cast<size_t>(b)] <= 0x1.cp127f &&
        block_err[static_cast<size_t>(b)] > amax[static_cast<size_t>(b)] / 16.0 * (1 + 0x1p-16))
      fail(b, -1, "block error beyond 2^-4 of the block maximum");
  EXPECT_EQ(bad, 0);
}

void check_blocked(const std::vector<float>& in, int64_t rows, int64_t cols,
                   fp8::BlockShape block) {
  for (fp8::ScaleRule rule : {fp8::ScaleRule::Fp32, fp8::ScaleRule::Pow2}) {
    SCOPED_TRACE(rule == fp8::ScaleRule::Fp32 ? "Fp32" : "Pow2");
    expect_blocked_matches_spec(in, rows, cols, block, rule,
                                quantize_blocked(in, rows, cols, block, rule));
  }
}

}  // namespace

// >= 10^6 activations, 1x128 blocks, rows ending in a half block.
TEST(Fp8Blocked, Activations1x128Random) {
  const int64_t rows = 512, cols = 2112;
  check_blocked(random_matrix(rows, cols, -30, 30, 3), rows, cols, fp8::kActivationBlock);
}

// >= 10^6 weights, 128x128 tiles cut by both edges; rows of one tile differ in magnitude.
TEST(Fp8Blocked, Weights128x128Random) {
  const int64_t rows = 1000, cols = 1100;
  check_blocked(random_matrix(rows, cols, -6, 6, 4), rows, cols, fp8::kWeightBlock);
}

TEST(Fp8Blocked, SpecialBlocks) {
  const int64_t rows = 2, cols = 8 * 128;
  std::vector<float> in(static_cast<size_t>(rows * cols));
  std::mt19937_64 rng(6);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (auto& x : in) x = gauss(rng);
  auto block = [&](int64_t r, int64_t b) { return in.data() + r * cols + b * 128; };
  for (int c = 0; c < 128; ++c) {
    block(0, 0)[c] = (c % 2) ? -0.0f : 0.0f;                                // all zero: s = 1
    block(0, 3)[c] *= 1e-38f;                                               // tiny: s clamped
    block(0, 4)[c] = float_of(static_cast<uint32_t>(rng()) & 0x807fffffu);  // fp32 subnormals
    block(0, 5)[c] *= 1e37f;                                                // near the top of fp32
    block(1, 2)[c] = (c == 100) ? 5.0f : 0.0f;  // zeros around one value
  }
  block(0, 1)[17] = kNaN;
  block(0, 2)[0] = kInf;
  block(0, 5)[9] = std::numeric_limits<float>::max();
  block(1, 6)[127] = -kInf;
  check_blocked(in, rows, cols, fp8::kActivationBlock);

  const BlockedResult r =
      quantize_blocked(in, rows, cols, fp8::kActivationBlock, fp8::ScaleRule::Fp32);
  EXPECT_EQ(r.scales[0], 1.0f);
  for (int c = 0; c < 128; ++c) EXPECT_EQ(r.q[static_cast<size_t>(c)], (c % 2) ? 0x80 : 0x00);
  EXPECT_TRUE(std::isnan(r.scales[1]));
  EXPECT_TRUE(std::isnan(r.scales[2]));
  EXPECT_EQ(r.scales[3], 0x1p-126f);
  EXPECT_EQ(r.scales[4], 0x1p-126f);
  EXPECT_EQ(r.scales[5], std::numeric_limits<float>::max() / 448.0f);
  EXPECT_EQ(r.q[static_cast<size_t>(5 * 128 + 9)], 0x7e);
  for (int64_t b : {0, 3, 4, 5, 7}) EXPECT_FALSE(std::isnan(r.scales[static_cast<size_t>(b)])) << b;
  EXPECT_TRUE(std::isnan(r.scales[8 + 6]));  // the poison stays in its block
  EXPECT_FALSE(std::isnan(r.scales[8 + 5]));
  EXPECT_FALSE(std::isnan(r.scales[8 + 7]));
  EXPECT_EQ(r.q[static_cast<size_t>(cols + 2 * 128 + 100)], 0x7e);
  EXPECT_EQ(r.out[static_cast<size_t>(cols + 2 * 128 + 100)], 5.0f);  // 448 * (5 / 448) rounds back
}

// Pow2 scales are the MX exponent, or one higher when the maximum's significand exceeds 1.75,
// so that no element saturates (what re-blocking MXFP8 to 1x128 on Hopper relies on), except at
// the top of fp32 where the scale stops at 2^119.
TEST(Fp8Blocked, Pow2ScaleIsTheMxExponentRoundedUp) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const float a = float_of(static_cast<uint32_t>(rng() % 0x7f000000u) + 0x00800000u);
    const float s = fp8::block_scale(a, fp8::ScaleRule::Pow2);
    int e = 0;
    const double m = 2 * std::frexp(static_cast<double>(a), &e);  // a = m * 2^(e-1), m in [1, 2)
    const int want = std::clamp(mx_expected_exponent(a) + (m > 1.75 ? 1 : 0), -126, 119);
    ASSERT_EQ(static_cast<double>(s), std::ldexp(1.0, want)) << std::hexfloat << a;
    if (a <= 0x1.cp127f) {  // 448 * 2^119: above it the cap saturates
      ASSERT_LE(a / s, 448.0f);
    }
  }
  EXPECT_EQ(fp8::block_scale(std::numeric_limits<float>::max(), fp8::ScaleRule::Pow2), 0x1p119f);
  EXPECT_EQ(fp8::block_scale(0x1.cp127f, fp8::ScaleRule::Pow2), 0x1p119f);
  EXPECT_EQ(fp8::block_scale(448.0f, fp8::ScaleRule::Pow2), 1.0f);  // 1.75 exactly: no step up
  EXPECT_EQ(fp8::block_scale(std::nextafter(448.0f, kInf), fp8::ScaleRule::Pow2), 2.0f);
  EXPECT_EQ(fp8::block_scale(0.0f, fp8::ScaleRule::Pow2), 1.0f);
  EXPECT_TRUE(std::isnan(fp8::block_scale(kInf, fp8::ScaleRule::Pow2)));
}

TEST(Fp8Blocked, Bf16InputAndOneBlockMatchTheFloatPath) {
  const int64_t rows = 130, cols = 300;
  const std::vector<float> f = random_matrix(rows, cols, -10, 10, 8);
  std::vector<mok::bf16> b;
  std::vector<float> widened;
  for (float x : f) {
    b.emplace_back(x);
    widened.push_back(static_cast<float>(b.back()));
  }
  for (fp8::BlockShape shape : {fp8::kActivationBlock, fp8::kWeightBlock}) {
    const size_t ns = static_cast<size_t>(fp8::scale_count(rows, cols, shape));
    std::vector<uint8_t> q1(f.size()), q2(f.size());
    std::vector<float> s1(ns), s2(ns);
    fp8::quantize_blocked(b.data(), rows, cols, shape, fp8::ScaleRule::Fp32, q1.data(), s1.data());
    fp8::quantize_blocked(widened.data(), rows, cols, shape, fp8::ScaleRule::Fp32, q2.data(),
                          s2.data());
    EXPECT_EQ(q1, q2);
    EXPECT_EQ(s1, s2);
  }
  std::vector<uint8_t> q1(f.size()), q2(128);
  std::vector<float> s1(static_cast<size_t>(rows * 3));
  fp8::quantize_1x128(b.data(), rows, cols, q1.data(), s1.data(), fp8::ScaleRule::Pow2);
  const float s =
      fp8::quantize_block(widened.data() + cols + 128, 128, fp8::ScaleRule::Pow2, q2.data());
  EXPECT_EQ(s, s1[3 + 1]);
  EXPECT_TRUE(std::equal(q2.begin(), q2.end(), q1.begin() + cols + 128));
}

TEST(Fp8Blocked, ArgumentErrorsAreNamed) {
  float x[4] = {};
  uint8_t q[4];
  float s[4];
  auto argument_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const mok::Error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  EXPECT_EQ(argument_of([&] { fp8::quantize_1x128(x, -1, 4, q, s); }), "rows");
  EXPECT_EQ(argument_of([&] { fp8::quantize_128x128(x, 1, -4, q, s); }), "cols");
  EXPECT_EQ(argument_of([&] {
              fp8::quantize_blocked(x, 1, 4, {0, 128}, fp8::ScaleRule::Fp32, q, s);
            }),
            "block");
  EXPECT_EQ(
      argument_of([&] { fp8::quantize_1x128(static_cast<const float*>(nullptr), 1, 4, q, s); }),
      "in");
  EXPECT_EQ(
      argument_of([&] { fp8::dequantize_blocked(q, s, 1, 4, fp8::kActivationBlock, nullptr); }),
      "out");
  EXPECT_EQ(argument_of([&] { fp8::quantize_mxfp8(x, 1, 4, q, nullptr); }), "scales");
  EXPECT_EQ(argument_of([&] { fp8::quantize_mx_block(x, 33, q); }), "n");
  EXPECT_EQ(argument_of([&] { fp8::quantize_block(x, 0, fp8::ScaleRule::Fp32, q); }), "n");
  EXPECT_EQ(argument_of([&] {
              fp8::quantize_1x128(static_cast<const float*>(nullptr), 0, 4, nullptr, nullptr);
            }),
            "(no error)");
}

// MXFP8 re-blocked to 1 x 128 power-of-two scales (fp8::reblock_mxfp8): each element keeps
// its MX value up to one E4M3 rounding at the 1 x 128 block's scale, 2^(largest MX exponent).
TEST(Fp8Blocked, MxReblockedTo1x128KeepsEachValueUpToOneRoundingAtTheLargestScale) {
  const int64_t rows = 6, cols = 328;  // two whole 1 x 128 blocks and a partial one (72 columns)
  std::mt19937 rng(71);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)  // MX blocks of different magnitudes inside a 128 block
      x[size_t(r * cols + c)] = g(rng) * std::ldexp(1.0f, int((c / 32) % 5) * 3 - 6 + int(r));
  const int64_t mx_cols = fp8::scale_cols(cols, fp8::kMxBlockShape);
  std::vector<uint8_t> q(x.size()), s(size_t(rows * mx_cols)), q2(x.size());
  std::vector<float> s2(size_t(fp8::scale_count(rows, cols, fp8::kActivationBlock))), mx(x.size()), re(x.size());
  fp8::quantize_mxfp8(x.data(), rows, cols, q.data(), s.data());
  fp8::dequantize_mxfp8(q.data(), s.data(), rows, cols, mx.data());
  fp8::reblock_mxfp8(q.data(), s.data(), rows, cols, fp8::kActivationBlock, q2.data(), s2.data());
  fp8::dequantize_blocked(q2.data(), s2.data(), rows, cols, fp8::kActivationBlock, re.data());
  int64_t exact = 0, changed = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b * 128 < cols; ++b) {
      int e_max = -127;
      for (int64_t j = b * 4; j < std::min<int64_t>(b * 4 + 4, mx_cols); ++j) e_max = std::max(e_max, int(s[size_t(r * mx_cols + j)]) - 127);
      const float scale = s2[size_t(r * fp8::scale_cols(cols, fp8::kActivationBlock) + b)];
      ASSERT_EQ(scale, std::ldexp(1.0f, e_max)) << "row " << r << " block " << b;
      for (int64_t c = b * 128; c < std::min<int64_t>(b * 128 + 128, cols); ++c) {
        const size_t i = size_t(r * cols + c);
        const int e = int(s[size_t(r * mx_cols + c / 32)]) - 127;
        // One E4M3 rounding at `scale`: half a step of 2^-3 relative (normals), or half of the
        // subnormal step 2^-9 * scale.
        const double bound = std::max(std::fabs(double(mx[i])) * 0x1p-4, 0x1p-10 * double(scale));
        EXPECT_LE(std::fabs(double(re[i]) - double(mx[i])), bound) << "row " << r << " col " << c;
        if (e == e_max) {
          EXPECT_EQ(q2[i], q[i]) << "the largest MX block keeps its codes (row " << r << " col " << c << ")";
        }
        (re[i] == mx[i] ? exact : changed) += 1;
      }
    }
  EXPECT_GT(changed, 0) << "the data must exercise the second rounding";
  EXPECT_GT(exact, changed);
  // A NaN MX block makes its whole 1 x 128 block NaN, and no other.
  s[size_t(1 * mx_cols + 5)] = fp8::kE8m0NaN;  // row 1, MX block 5: inside 1 x 128 block 1
  fp8::reblock_mxfp8(q.data(), s.data(), rows, cols, fp8::kActivationBlock, q2.data(), s2.data());
  const int64_t sc = fp8::scale_cols(cols, fp8::kActivationBlock);
  EXPECT_TRUE(std::isnan(s2[size_t(1 * sc + 1)]));
  EXPECT_FALSE(std::isnan(s2[size_t(1 * sc + 0)]));
  EXPECT_FALSE(std::isnan(s2[size_t(1 * sc + 2)]));
  for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(q2[size_t(1 * cols + c)], fp8::kE4m3NaN);
  EXPECT_THROW(fp8::reblock_mxfp8(q.data(), nullptr, rows, cols, fp8::kActivationBlock, q2.data(), s2.data()), mok::Error);
  EXPECT_THROW(fp8::reblock_mxfp8(q.data(), s.data(), rows, cols, fp8::BlockShape{1, 48}, q2.data(), s2.data()), mok::Error);
}
