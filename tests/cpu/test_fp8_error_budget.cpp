// What the FP8 recipes cost on Gaussian data, operand by operand (notes/fp8.md, "Accuracy"): one
// GEMM y = x W^T at DeepSeek-V3's K (H = 7168), in fp64, against the same GEMM with x quantized
// (1 x 128 blocks, fp32 scales), with W quantized (128 x 128 blocks), with both, and with both as
// MXFP8 (E8M0 scales per 32). E4M3 keeps 3 mantissa bits: one quantized operand alone moves the
// product by ~2.5% in norm, because a dot product over random signs does not average the
// elements' relative errors away (sum and error both grow as sqrt(K)). The layer quantizes four
// operands (x, W_gate/W_up, h, W_down), so it cannot come within 3e-2 of the fp64 model on such
// data whatever the kernels do; this test measures the budget (and fails if the recipe's
// quantization ever got worse than these bounds).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "mok/bf16.hpp"
#include "reference/fp8_quant.h"

namespace fp8 = mok::fp8;

namespace {

constexpr int64_t kRows = 64, kK = 7168, kN = 512;

std::vector<float> gaussian_bf16(int64_t n, uint32_t seed) {  // bf16-representable, as the layer's inputs
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& e : v) e = mok::round_bf16(g(rng));
  return v;
}

std::vector<float> blocked(const std::vector<float>& v, int64_t rows, int64_t cols, fp8::BlockShape b) {
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(size_t(fp8::scale_count(rows, cols, b))), out(v.size());
  fp8::quantize_blocked(v.data(), rows, cols, b, fp8::ScaleRule::Fp32, q.data(), s.data());
  fp8::dequantize_blocked(q.data(), s.data(), rows, cols, b, out.data());
  return out;
}

// MXFP8 as the spec computes it (reblock = false), or re-blocked to power-of-two scales per `to`
// block for Hopper's once-per-128 promotion (fp8::reblock_mxfp8).
std::vector<float> mx(const std::vector<float>& v, int64_t rows, int64_t cols, bool reblock = false,
                      fp8::BlockShape to = fp8::kActivationBlock) {
  std::vector<uint8_t> q(v.size()), s(size_t(fp8::scale_count(rows, cols, fp8::kMxBlockShape)));
  std::vector<float> out(v.size());
  fp8::quantize_mxfp8(v.data(), rows, cols, q.data(), s.data());
  if (!reblock) {
    fp8::dequantize_mxfp8(q.data(), s.data(), rows, cols, out.data());
    return out;
  }
  std::vector<uint8_t> q2(v.size());
  std::vector<float> s2(size_t(fp8::scale_count(rows, cols, to)));
  fp8::reblock_mxfp8(q.data(), s.data(), rows, cols, to, q2.data(), s2.data());
  fp8::dequantize_blocked(q2.data(), s2.data(), rows, cols, to, out.data());
  return out;
}

// y[r, n] = sum_k x[r, k] w[n, k] in fp64.
std::vector<double> gemm(const std::vector<float>& x, const std::vector<float>& w) {
  std::vector<double> y(size_t(kRows * kN));
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t n = 0; n < kN; ++n) {
      double s = 0;
      for (int64_t k = 0; k < kK; ++k) s += double(x[size_t(r * kK + k)]) * double(w[size_t(n * kK + k)]);
      y[size_t(r * kN + n)] = s;
    }
  return y;
}

template <class T>
double rel(const std::vector<T>& got, const std::vector<T>& want) {
  double d = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    d += (double(got[i]) - double(want[i])) * (double(got[i]) - double(want[i]));
    n += double(want[i]) * double(want[i]);
  }
  return std::sqrt(d / n);
}

}  // namespace

TEST(Fp8ErrorBudget, OneQuantizedOperandCostsAboutTwoAndAHalfPercentInNorm) {
  const auto x = gaussian_bf16(kRows * kK, 1), w = gaussian_bf16(kN * kK, 2);
  const auto xq = blocked(x, kRows, kK, fp8::kActivationBlock), wq = blocked(w, kN, kK, fp8::kWeightBlock);
  const auto xm = mx(x, kRows, kK), wm = mx(w, kN, kK);
  const auto y = gemm(x, w);
  const double e_x = rel(xq, x), e_w = rel(wq, w), e_xm = rel(xm, x);
  const double y_x = rel(gemm(xq, w), y), y_w = rel(gemm(x, wq), y), y_xw = rel(gemm(xq, wq), y);
  const double y_mx = rel(gemm(xm, wm), y);
  std::printf("[fp8 budget] elements: x 1x128 %.2e, W 128x128 %.2e, x MXFP8 %.2e (norm-relative)\n", e_x, e_w, e_xm);
  std::printf("[fp8 budget] y = x W^T (K %lld): x quantized %.2e, W quantized %.2e, both %.2e; both as MXFP8 %.2e\n",
              (long long)kK, y_x, y_w, y_xw, y_mx);
  // One operand: ~2.4% (3 mantissa bits, round to nearest: ulp / sqrt(12) over a binade).
  for (const double e : {e_x, e_w, e_xm, y_x, y_w}) {
    EXPECT_GT(e, 1.5e-2);
    EXPECT_LT(e, 3.5e-2);
  }
  // Two operands add in quadrature: one FP8 GEMM alone is already past 3e-2 of fp64.
  EXPECT_NEAR(y_xw, std::hypot(y_x, y_w), 0.1 * y_xw);
  EXPECT_GT(y_xw, 3e-2);
  EXPECT_GT(y_mx, 3e-2);
  EXPECT_LT(y_mx, 5e-2);
}

// MXFP8 on Hopper (notes/fp8.md, "MXFP8 on Hopper"): the GEMM of the MX operands as the spec
// quantizes them against the GEMM of the same operands re-blocked to the power-of-two scales
// recipe 1's GEMMs read (x per 1 x 128, W per 1 x 128 or per 128 x 128: the layout of the existing
// FP8 forms), both in fp64 over the dequantized values: what the second rounding costs (the
// GPU's accumulation order is a separate, smaller matter). On Gaussian data and on activations with outlier channels (1 in 64
// channels x 32, the kind that sets a block's scale), W Gaussian.
TEST(Fp8ErrorBudget, MxReblockedAgainstMxAsSpecified) {
  const auto w = gaussian_bf16(kN * kK, 2);
  const auto wm = mx(w, kN, kK), wr = mx(w, kN, kK, true), wr128 = mx(w, kN, kK, true, fp8::kWeightBlock);
  std::printf("[mx reblock] W elements: MX %.3e, re-blocked 1x128 %.3e, 128x128 %.3e (norm-relative to bf16)\n",
              rel(wm, w), rel(wr, w), rel(wr128, w));
  for (const bool outliers : {false, true}) {
    auto x = gaussian_bf16(kRows * kK, 1);
    if (outliers)
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t k = 0; k < kK; k += 64) x[size_t(r * kK + k)] = mok::round_bf16(32.0f * x[size_t(r * kK + k)]);
    const auto y = gemm(x, w);
    const auto xm = mx(x, kRows, kK), xr = mx(x, kRows, kK, true);
    const double y_r1 = rel(gemm(blocked(x, kRows, kK, fp8::kActivationBlock), blocked(w, kN, kK, fp8::kWeightBlock)), y);
    const double y_mx = rel(gemm(xm, wm), y);
    const double y_re = rel(gemm(xr, wr), y), y_re128 = rel(gemm(xr, wr128), y);
    std::printf("[mx reblock] %s x: y rel err recipe 1 %.4e, MXFP8 as specified %.4e, re-blocked x 1x128 + W 1x128 "
                "%.4e, x 1x128 + W 128x128 %.4e; x elements changed by re-blocking %.2e of the MX values' norm\n",
                outliers ? "outlier" : "Gaussian", y_r1, y_mx, y_re, y_re128, rel(xr, xm));
    EXPECT_LT(y_mx, outliers ? 6e-2 : 5e-2);
    EXPECT_GT(rel(xr, xm), 0.0) << "the data must exercise the re-blocking's rounding";
    // Re-blocking only moves exponents (exact within E4M3's 14 normal binades below the block's
    // top), so the GEMM's error stays the spec's to within a few percent of itself.
    EXPECT_LT(y_re, 1.05 * y_mx);
    EXPECT_LT(y_re128, 1.05 * y_mx);
  }
}
