// Test-side references for the FP8 tests, written from the format definitions rather than from
// the implementation: E4M3 values from sign/exponent/mantissa, conversion by nearest-neighbour
// search over the finite values, MX scale exponents from std::frexp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "reference/fp8_quant.h"

namespace fp8_test {

inline uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
inline float float_of(uint32_t u) { return std::bit_cast<float>(u); }
inline const float kNaN = std::numeric_limits<float>::quiet_NaN();
inline const float kInf = std::numeric_limits<float>::infinity();

// The value of an E4M3 code by the format's definition: bias 7, subnormals at exponent field 0,
// S.1111.111 the only NaN, no infinities.
inline double e4m3_value(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// The 127 non-negative finite E4M3 values, codes 0x00..0x7E (increasing with the code).
inline const std::vector<double>& positive_values() {
  static const std::vector<double> v = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7e; ++c) t.push_back(e4m3_value(c));
    return t;
  }();
  return v;
}

// Slow reference: the nearest finite E4M3 value by exhaustive search, ties to the even code (the
// even mantissa); beyond 448 (Inf included) the saturating conversion gives 448; NaN gives 0x7F;
// the result carries the input's sign, zero included.
inline uint8_t e4m3_reference(float f) {
  if (std::isnan(f)) return 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  int best = 0x7e;
  if (a <= 448.0) {
    double best_d = std::numeric_limits<double>::infinity();
    const auto& v = positive_values();
    for (int c = 0; c <= 0x7e; ++c) {
      const double d = std::fabs(a - v[c]);  // exact near a tie: both operands are close
      if (d < best_d || (d == best_d && (c & 1) == 0)) {
        best = c;
        best_d = d;
      }
    }
  }
  return static_cast<uint8_t>((std::signbit(f) ? 0x80 : 0) | best);
}

// Expected MX shared exponent from the spec's formula with an exact floor(log2) (std::frexp).
inline int mx_expected_exponent(float amax) {
  if (amax == 0.0f) return -127;
  int e = 0;
  std::frexp(static_cast<double>(amax), &e);  // amax = m * 2^e, m in [0.5, 1)
  return std::max(-127, (e - 1) - 8);
}

// Random matrix whose rows have very different magnitudes: gaussian values times 2^row_exp[r],
// with a sprinkling of outliers, exact zeros and negative zeros.
inline std::vector<float> random_matrix(int64_t rows, int64_t cols, int lo_exp, int hi_exp,
                                        uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_dist(lo_exp, hi_exp);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  std::vector<float> m(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const int row_exp = exp_dist(rng);
    for (int64_t c = 0; c < cols; ++c) {
      float v = gauss(rng);
      const float p = u01(rng);
      if (p < 0.01f)
        v = 0.0f;
      else if (p < 0.015f)
        v = -0.0f;
      else if (p < 0.02f)
        v *= 64.0f;  // outlier
      m[static_cast<size_t>(r * cols + c)] = std::ldexp(v, row_exp);
    }
  }
  return m;
}

inline int64_t block_index(int64_t r, int64_t c, int64_t cols, mok::fp8::BlockShape b) {
  return (r / b.rows) * mok::fp8::scale_cols(cols, b) + c / b.cols;
}

}  // namespace fp8_test
