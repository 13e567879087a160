// The FP8 element formats of src/common/fp8_format.h (E4M3, E8M0, the block maximum) and MXFP8
// (with the host quantizer of src/reference/fp8_quant.*) against the references of
// fp8_test_reference.h.
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

// ---- E4M3 ------------------------------------------------------------------------------------

TEST(Fp8E4m3, DecodesEveryCodeAsDefined) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float got = fp8::e4m3_decode(static_cast<uint8_t>(c));
    const double want = e4m3_value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_EQ(std::signbit(got), c >= 0x80) << c;
      EXPECT_TRUE(fp8::e4m3_is_nan(static_cast<uint8_t>(c)));
      ++nans;
      continue;
    }
    EXPECT_EQ(bits_of(got), bits_of(static_cast<float>(want))) << "code " << c;  // -0 included
    EXPECT_FALSE(fp8::e4m3_is_nan(static_cast<uint8_t>(c)));
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(fp8::e4m3_decode(0x7e), 448.0f);
  EXPECT_EQ(fp8::e4m3_decode(0xfe), -448.0f);
  EXPECT_EQ(fp8::e4m3_decode(0x01), 0x1p-9f);
  EXPECT_EQ(fp8::e4m3_decode(0x08), 0x1p-6f);
  EXPECT_EQ(fp8::e4m3_decode(0x07), 7 * 0x1p-9f);
}

// The functions are constexpr: a kernel or a table can use them at compile time.
static_assert(fp8::e4m3_decode(0x7e) == 448.0f);
static_assert(fp8::e4m3_encode(1e30f) == 0x7e);
static_assert(fp8::e4m3_encode(0x1p-10f) == 0x00);
static_assert(fp8::mxfp8_scale_code(1.0f) == 127 - 8);
static_assert(fp8::e8m0_decode(127) == 1.0f);

TEST(Fp8E4m3, EncodeInvertsDecodeOnEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if (fp8::e4m3_is_nan(static_cast<uint8_t>(c))) continue;
    EXPECT_EQ(fp8::e4m3_encode(fp8::e4m3_decode(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(fp8::e4m3_encode(0.0f), 0x00);
  EXPECT_EQ(fp8::e4m3_encode(-0.0f), 0x80);
  EXPECT_EQ(fp8::e4m3_encode(fp8::e4m3_decode(0x7f)), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(fp8::e4m3_decode(0xff)), 0x7f);  // NaN's sign is not kept
}

TEST(Fp8E4m3, SpecialValuesAndBoundaries) {
  EXPECT_EQ(fp8::e4m3_encode(kNaN), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(-kNaN), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(float_of(0x7f800001u)), 0x7f);  // signalling NaN
  EXPECT_EQ(fp8::e4m3_encode(float_of(0xffffffffu)), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(kInf), 0x7e);  // satfinite
  EXPECT_EQ(fp8::e4m3_encode(-kInf), 0xfe);
  EXPECT_EQ(fp8::e4m3_encode(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(fp8::e4m3_encode(-1e20f), 0xfe);
  EXPECT_EQ(fp8::e4m3_encode(464.0f), 0x7e);  // tie between 448 (even) and 480 (absent)
  EXPECT_EQ(fp8::e4m3_encode(std::nextafter(448.0f, 0.0f)), 0x7e);
  EXPECT_EQ(fp8::e4m3_encode(432.0f), 0x7e);  // tie between 416 (odd) and 448 (even)
  EXPECT_EQ(fp8::e4m3_encode(std::nextafter(432.0f, 0.0f)), 0x7d);
  EXPECT_EQ(fp8::e4m3_encode(0x1p-10f), 0x00);  // tie between 0 and 2^-9: to zero
  EXPECT_EQ(fp8::e4m3_encode(-0x1p-10f), 0x80);
  EXPECT_EQ(fp8::e4m3_encode(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(fp8::e4m3_encode(3 * 0x1p-10f), 0x02);   // tie between 1 and 2 * 2^-9
  EXPECT_EQ(fp8::e4m3_encode(15 * 0x1p-10f), 0x08);  // tie between 7 * 2^-9 and 2^-6
  EXPECT_EQ(fp8::e4m3_encode(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(fp8::e4m3_encode(-std::numeric_limits<float>::min()), 0x80);
  EXPECT_EQ(fp8::e4m3_encode(1.0f), 0x38);
  EXPECT_EQ(fp8::e4m3_encode(1.0625f), 0x38);  // tie between 1 and 1.125: to 1 (even)
  EXPECT_EQ(fp8::e4m3_encode(1.1875f), 0x3a);  // tie between 1.125 and 1.25: to 1.25 (even)
}

// >= 10^6 inputs of every kind against the nearest-neighbour reference, bit for bit.
TEST(Fp8E4m3, EncodeMatchesNearestNeighbourSearch) {
  std::vector<float> in;
  std::mt19937_64 rng(22);
  // Any bit pattern: NaNs, infinities, fp32 subnormals, every binade.
  for (int i = 0; i < (1 << 20); ++i) in.push_back(float_of(static_cast<uint32_t>(rng())));
  // Log-uniform over the binades where rounding happens, both signs.
  std::uniform_int_distribution<int> e_dist(-14, 10);
  for (int i = 0; i < (1 << 19); ++i) {
    const uint32_t mant = static_cast<uint32_t>(rng()) & 0x7fffffu;
    const uint32_t sign = static_cast<uint32_t>(rng() & 1) << 31;
    in.push_back(float_of(sign | (static_cast<uint32_t>(e_dist(rng) + 127) << 23) | mant));
  }
  // Exact halfway points between neighbours (0 and 2^-9 included, 464 above 448), 3 ulps around.
  const auto& v = positive_values();
  std::vector<double> mids;
  for (size_t c = 0; c + 1 < v.size(); ++c) mids.push_back((v[c] + v[c + 1]) / 2);
  mids.push_back(464.0);
  for (double mid : mids) {
    const float m = static_cast<float>(mid);
    EXPECT_EQ(static_cast<double>(m), mid);  // every midpoint is an fp32 value
    for (float x : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e9f),
                    std::nextafter(std::nextafter(m, 0.0f), 0.0f),
                    std::nextafter(std::nextafter(m, 1e9f), 1e9f)}) {
      in.push_back(x);
      in.push_back(-x);
    }
  }
  // Just above 448, up to beyond 480 and 512, and huge values.
  for (int k = 0; k < 5000; ++k)
    in.push_back(float_of(bits_of(448.0f) + static_cast<uint32_t>(k) * 97u));
  for (float x :
       {480.0f, 512.0f, 1e4f, 1e38f, std::numeric_limits<float>::max(), kInf, -kInf, kNaN, -kNaN,
        0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    in.push_back(x);
  ASSERT_GE(in.size(), 1000000u);

  int64_t bad = 0;
  for (float x : in) {
    const uint8_t got = fp8::e4m3_encode(x), want = e4m3_reference(x);
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << std::hexfloat << x << ": got 0x" << std::hex << int(got) << ", want 0x"
                    << int(want);
  }
  EXPECT_EQ(bad, 0) << "of " << in.size();
}

// Every fp32 value in [2^-11, 2^9) (every input that rounds to neither zero nor saturates, and
// the boundaries on both sides), against a second reference: a walk along the sorted values.
TEST(Fp8E4m3, EncodeExhaustiveOverTheRoundingRange) {
  const auto& v = positive_values();
  size_t c = 0;
  int64_t bad = 0, count = 0;
  for (uint32_t u = bits_of(0x1p-11f); u < bits_of(0x1p9f); ++u, ++count) {
    const float x = float_of(u);
    const double a = x;
    while (c + 1 < v.size() && v[c + 1] <= a) ++c;
    int want = 0x7e;
    if (c + 1 < v.size()) {
      const double below = a - v[c], above = v[c + 1] - a;
      want = below < above ? int(c) : above < below ? int(c + 1) : int(c % 2 == 0 ? c : c + 1);
    }
    const uint8_t got = fp8::e4m3_encode(x);
    const uint8_t got_neg = fp8::e4m3_encode(-x);
    if ((got != want || got_neg != (want | 0x80)) && ++bad <= 10)
      ADD_FAILURE() << std::hexfloat << x << ": got 0x" << std::hex << int(got) << ", want 0x"
                    << want;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(count, 20 * (int64_t{1} << 23));
}

// ---- E8M0 and the block maximum --------------------------------------------------------------

TEST(Fp8E8m0, EveryCode) {
  for (int c = 0; c < 255; ++c) {
    const float x = fp8::e8m0_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(x), std::ldexp(1.0, c - 127)) << c;
    EXPECT_EQ(fp8::e8m0_encode(x), c) << c;
    EXPECT_EQ(fp8::e8m0_from_exponent(c - 127), c);
  }
  EXPECT_TRUE(std::isnan(fp8::e8m0_decode(0xff)));
  EXPECT_EQ(fp8::e8m0_from_exponent(-128), 0xff);
  EXPECT_EQ(fp8::e8m0_from_exponent(128), 0xff);
  for (float x :
       {0.0f, -0.0f, -1.0f, 3.0f, 1.5f, 0x1p-128f, kInf, kNaN, std::numeric_limits<float>::max()})
    EXPECT_EQ(fp8::e8m0_encode(x), 0xff) << x;
}

TEST(Fp8Amax, NaNWinsAndSignsAreDropped) {
  EXPECT_EQ(fp8::amax_update(0.0f, -3.0f), 3.0f);
  EXPECT_EQ(fp8::amax_update(5.0f, -3.0f), 5.0f);
  EXPECT_EQ(bits_of(fp8::amax_update(0.0f, -0.0f)), 0u);
  EXPECT_EQ(fp8::amax_update(1.0f, -kInf), kInf);
  EXPECT_TRUE(std::isnan(fp8::amax_update(kInf, -kNaN)));
  EXPECT_TRUE(std::isnan(fp8::amax_update(kNaN, 1e30f)));
}

// ---- MXFP8 -----------------------------------------------------------------------------------

namespace {

// Checks an MX quantization of in[rows, cols] against the spec, block by block and element by
// element, and its dequantization against the exact values and the error bounds.
void expect_mx_matches_spec(const std::vector<float>& in, int64_t rows, int64_t cols,
                            const std::vector<uint8_t>& q, const std::vector<uint8_t>& scales) {
  std::vector<float> out(in.size());
  fp8::dequantize_mxfp8(q.data(), scales.data(), rows, cols, out.data());
  const int64_t grid = fp8::scale_cols(cols, fp8::kMxBlockShape);
  int64_t bad = 0;
  auto fail = [&](int64_t r, int64_t c, const char* what) {
    if (++bad <= 10) ADD_FAILURE() << what << " at (" << r << ", " << c << ")";
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < grid; ++b) {
      const int64_t c0 = b * 32, c1 = std::min(cols, c0 + 32);
      const float* v = in.data() + r * cols;
      bool finite = true;
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) {
        finite = finite && std::isfinite(v[c]);
        amax = std::max(amax, std::fabs(v[c]));
      }
      const uint8_t code = scales[static_cast<size_t>(r * grid + b)];
      if (!finite) {
        if (code != 0xff) fail(r, c0, "scale of a non-finite block is not NaN");
        for (int64_t c = c0; c < c1; ++c)
          if (q[static_cast<size_t>(r * cols + c)] != 0x7f ||
              !std::isnan(out[static_cast<size_t>(r * cols + c)]))
            fail(r, c, "element of a non-finite block is not NaN");
        continue;
      }
      const int shared = mx_expected_exponent(amax);
      if (code != shared + 127) fail(r, c0, "scale exponent");
      for (int64_t c = c0; c < c1; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        // V / X rounded once to fp32, as the element rule forms it; exact unless tiny.
        const float t = static_cast<float>(std::ldexp(static_cast<double>(v[c]), -shared));
        if (q[i] != e4m3_reference(t)) fail(r, c, "element code");
        const double deq = std::ldexp(e4m3_value(q[i]), shared);
        if (bits_of(out[i]) != bits_of(static_cast<float>(deq)) ||
            static_cast<double>(out[i]) != deq)
          fail(r, c, "dequantized value is not decode(q) * X exactly");
        const double at = std::fabs(static_cast<double>(t));
        const double bound = at > 448.0 ? at - 448.0 : std::max(at / 16.0, 0x1p-10);
        if (std::fabs(deq - static_cast<double>(v[c])) > std::ldexp(bound, shared) * (1 + 0x1p-20))
          fail(r, c, "round-trip error beyond the bound");
        if (v[c] == 0.0f && bits_of(out[i]) != bits_of(v[c])) fail(r, c, "zero not kept exactly");
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

void quantize_and_check_mx(const std::vector<float>& in, int64_t rows, int64_t cols) {
  std::vector<uint8_t> q(in.size()),
      scales(static_cast<size_t>(fp8::scale_count(rows, cols, fp8::kMxBlockShape)));
  fp8::quantize_mxfp8(in.data(), rows, cols, q.data(), scales.data());
  expect_mx_matches_spec(in, rows, cols, q, scales);
}

}  // namespace

// floor(log2(amax)) exactly, including just below every power of two (where a float log2 rounds
// up) and over the fp32 subnormals, where the clamp to 2^-127 applies.
TEST(Fp8Mx, ScaleExponentIsTheExactFloorLog2MinusEight) {
  int checked = 0;
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    for (float a : {p, std::nextafter(p, 0.0f), std::nextafter(p, kInf), 1.75f * p, 1.9f * p}) {
      if (a == 0.0f || std::isinf(a)) continue;
      EXPECT_EQ(fp8::mxfp8_scale_code(a), mx_expected_exponent(a) + 127) << std::hexfloat << a;
      EXPECT_EQ(fp8::mxfp8_scale_code(-a), fp8::mxfp8_scale_code(a));
      ++checked;
    }
  }
  EXPECT_GT(checked, 1300);
  // An fp32 subnormal maximum is clamped by every rule, so its exact binade never shows in a
  // scale: the helper is checked directly.
  for (int k = -149; k < -126; ++k) EXPECT_EQ(fp8::detail::binade(std::ldexp(1.0f, k)).exponent, k);
  EXPECT_EQ(fp8::detail::binade(3 * std::numeric_limits<float>::denorm_min()).sig, 0x00c00000u);
  EXPECT_EQ(fp8::mxfp8_scale_code(0.0f), 0);      // log2(0) = -Inf, clamped to 2^-127
  EXPECT_EQ(fp8::mxfp8_scale_code(1.0f), 119);    // 2^(0 - 8)
  EXPECT_EQ(fp8::mxfp8_scale_code(448.0f), 127);  // 448 = 1.75 * 2^8: X = 1
  EXPECT_EQ(fp8::mxfp8_scale_code(std::numeric_limits<float>::max()), 246);  // 2^(127 - 8)
  EXPECT_EQ(fp8::mxfp8_scale_code(0x1p-119f), 0);                            // exactly the clamp
  EXPECT_EQ(fp8::mxfp8_scale_code(0x1p-118f), 1);
  EXPECT_EQ(fp8::mxfp8_scale_code(kInf), 0xff);
  EXPECT_EQ(fp8::mxfp8_scale_code(kNaN), 0xff);
}

// >= 10^6 values in blocks over a wide range of magnitudes, rows ending in a partial block.
TEST(Fp8Mx, RandomBlocksMatchTheSpec) {
  const int64_t rows = 1024, cols = 1040;  // 32.5 blocks per row
  quantize_and_check_mx(random_matrix(rows, cols, -40, 40, 1), rows, cols);
  // Magnitudes from the fp32 subnormals (the clamped scale) to near the top of fp32.
  quantize_and_check_mx(random_matrix(256, cols, -155, 118, 2), 256, cols);
}

TEST(Fp8Mx, SpecialBlocks) {
  const int64_t rows = 8, cols = 32;
  std::vector<float> in(static_cast<size_t>(rows * cols));
  auto row = [&](int64_t r) { return in.data() + r * cols; };
  std::mt19937_64 rng(5);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (int c = 0; c < cols; ++c) {
    row(0)[c] = (c % 3 == 0) ? -0.0f : 0.0f;                           // all zero
    row(1)[c] = gauss(rng);                                            // one huge value
    row(2)[c] = gauss(rng);                                            // a NaN
    row(3)[c] = gauss(rng);                                            // an Inf
    row(4)[c] = float_of(static_cast<uint32_t>(rng()) & 0x807fffffu);  // fp32 subnormals only
    row(5)[c] = std::ldexp(gauss(rng), 6);                             // max clamped to 448 X
    row(6)[c] = 0.0f;                                                  // zeros and one tiny
    row(7)[c] = -std::ldexp(std::fabs(gauss(rng)), 100);
  }
  row(1)[7] = 3e38f;
  row(2)[30] = kNaN;
  row(3)[0] = -kInf;
  row(5)[3] = 1.99f * 1024.0f;  // t = 1.99 * 2^8 = 509.4 > 448: the spec's clamp
  row(6)[9] = std::numeric_limits<float>::min();
  std::vector<uint8_t> q(in.size()), scales(static_cast<size_t>(rows));
  fp8::quantize_mxfp8(in.data(), rows, cols, q.data(), scales.data());
  expect_mx_matches_spec(in, rows, cols, q, scales);

  EXPECT_EQ(scales[0], 0);  // 2^-127
  for (int c = 0; c < cols; ++c) EXPECT_EQ(q[static_cast<size_t>(c)], (c % 3 == 0) ? 0x80 : 0x00);
  EXPECT_EQ(scales[1], 127 + 127 - 8);
  EXPECT_EQ(q[static_cast<size_t>(cols + 7)], 0x7e);  // 3e38 / 2^119 = 451: saturated
  EXPECT_EQ(scales[2], 0xff);
  EXPECT_EQ(scales[3], 0xff);
  EXPECT_EQ(scales[4], 0);  // subnormal amax: clamped to 2^-127
  EXPECT_EQ(scales[5], 127 + 10 - 8);
  EXPECT_EQ(q[static_cast<size_t>(5 * cols + 3)], 0x7e);
  EXPECT_EQ(scales[6], 0);  // amax 2^-126: 2^-134 clamped to 2^-127
}

TEST(Fp8Mx, PartialTailBlockIsItsOwnBlock) {
  const int64_t cols = 40;
  std::vector<float> in(cols, 1000.0f);
  for (int c = 32; c < cols; ++c) in[static_cast<size_t>(c)] = 0.01f * static_cast<float>(c);
  std::vector<uint8_t> q(cols), scales(2);
  fp8::quantize_mxfp8(in.data(), 1, cols, q.data(), scales.data());
  EXPECT_EQ(scales[0], 127 + 9 - 8);
  EXPECT_EQ(scales[1], 127 - 2 - 8);  // the tail's own max 0.39, in [2^-2, 2^-1)
  expect_mx_matches_spec(in, 1, cols, q, scales);
}

TEST(Fp8Mx, DequantizedValuesAreExact) {
  for (int x = 0; x <= 246; ++x) {  // every scale an E4M3 block can get
    for (int c = 0; c < 256; ++c) {
      if (fp8::e4m3_is_nan(static_cast<uint8_t>(c))) continue;
      const float got = fp8::mxfp8_decode(static_cast<uint8_t>(c), static_cast<uint8_t>(x));
      ASSERT_EQ(static_cast<double>(got), std::ldexp(e4m3_value(c), x - 127)) << c << " " << x;
    }
  }
  EXPECT_TRUE(std::isnan(fp8::mxfp8_decode(0x38, 0xff)));
}

TEST(Fp8Mx, Bf16InputIsTheFloatPathOnItsValues) {
  const int64_t rows = 64, cols = 96;
  const std::vector<float> f = random_matrix(rows, cols, -20, 20, 9);
  std::vector<mok::bf16> b;
  std::vector<float> widened;
  for (float x : f) {
    b.emplace_back(x);
    widened.push_back(static_cast<float>(b.back()));
  }
  std::vector<uint8_t> q1(f.size()), q2(f.size()), s1(rows * 3), s2(rows * 3);
  fp8::quantize_mxfp8(b.data(), rows, cols, q1.data(), s1.data());
  fp8::quantize_mxfp8(widened.data(), rows, cols, q2.data(), s2.data());
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(s1, s2);
  uint8_t q3[32];
  EXPECT_EQ(fp8::quantize_mx_block(widened.data() + 32, 32, q3), s2[1]);
  EXPECT_TRUE(std::equal(q3, q3 + 32, q2.begin() + 32));
}
