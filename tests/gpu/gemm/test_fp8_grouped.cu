// The block-scaled FP8 grouped GEMM (gemm::plan_fp8_grouped, Form::Fp8Plain) against the
// quantization-emulating reference: activations and weights quantized by the CPU spec
// (src/reference/fp8_quant.h: 1 x 128 and 128 x 128 blocks, fp32 scales), the product of the
// decoded values in fp64, with 128- and 256-wide tiles. The error allowed is the tensor cores' FP8 accumulation over each 128
// of K plus the bf16 output's rounding, relative to sum |a w| of the output (what an error of the
// layout, of a descriptor or of a scale's place would exceed by orders of magnitude). Rows of
// different magnitudes (2^-6 .. 2^6) and weight blocks of different magnitudes make every scale
// matter; experts of 200, 128, 0 and 77 rows make partial and empty tiles; padding rows hold NaN
// codes whose rows are never read back. The unquantized bf16 product is reported beside it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "reference/fp8_quant.h"

namespace {

using mok::test::bits_of;
using mok::test::DevBuf;
using mok::test::download;
using mok::test::float_of;
using mok::test::random_bf16;
using mok::test::Routed;
using mok::test::upload;
namespace fp8 = mok::fp8;

void run_case(const std::vector<int32_t>& counts, int64_t k, int64_t n, int block_n) {
  SCOPED_TRACE(testing::Message() << "k " << k << ", n " << n << ", BLOCK_N " << block_n);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, kb = k / 128;
  // Activations: row r scaled by 2^((r % 13) - 6); padding rows NaN.
  std::vector<uint16_t> x = random_bf16(size_t(rows * k), 5 + k);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      uint16_t& v = x[size_t(r * k + c)];
      v = rt.expert_of(r) < 0 ? uint16_t(0x7fc0) : bits_of(std::ldexp(float_of(v), int(r % 13) - 6));
    }
  // Weights: block (i, j) of expert e scaled by 2^((e + i + 2j) % 9 - 4).
  std::vector<uint16_t> w = random_bf16(size_t(E * n * k), 9 + n, 0.05);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < k; ++c) {
        uint16_t& v = w[size_t((e * n + i) * k + c)];
        v = bits_of(std::ldexp(float_of(v), int((e + i / 128 + 2 * (c / 128)) % 9) - 4));
      }
  std::vector<uint8_t> qx(x.size()), qw(w.size());
  std::vector<float> sx(size_t(rows * kb)), sw(size_t(E * (n / 128) * kb));
  fp8::quantize_1x128(reinterpret_cast<const mok::bf16*>(x.data()), rows, k, qx.data(), sx.data());
  for (int64_t e = 0; e < E; ++e)
    fp8::quantize_128x128(reinterpret_cast<const mok::bf16*>(w.data()) + e * n * k, n, k, qw.data() + e * n * k,
                          sw.data() + e * (n / 128) * kb);
  DevBuf dqx(qx.size()), dsx(sx.size() * 4), dqw(qw.size()), dsw(sw.size() * 4), dy(size_t(rows * n) * 2),
      dte(rt.tile_expert.size() * 4 + 4);
  upload(dqx, qx);
  upload(dsx, sx);
  upload(dqw, qw);
  upload(dsw, sw);
  upload(dte, rt.tile_expert);
  MOK_ASSERT_CUDA(cudaMemset(dy.p, 0xff, dy.bytes));
  mok::gemm::Fp8GroupedArgs a;
  a.a = dqx.p;
  a.a_scales = dsx.as<float>();
  a.w = dqw.p;
  a.w_scales = dsw.as<float>();
  a.y = dy.p;
  a.k = k;
  a.n = n;
  a.experts = E;
  a.tile_expert = dte.as<int32_t>();
  a.num_m_tiles = rt.num_m_tiles();
  DevBuf err(4);
  MOK_ASSERT_CUDA(cudaMemset(err.p, 0, 4));
  mok::gemm::Options o;
  o.error = err.as<unsigned>();
  o.block_n = block_n;
  const mok::gemm::Plan plan = mok::gemm::plan_fp8_grouped(a, o);
  EXPECT_EQ(plan.block_n, block_n);
  mok::gemm::run(plan, nullptr);
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  const auto y = download<uint16_t>(dy, size_t(rows * n));
  double worst = 0, worst_bf16 = 0;
  int64_t nonfinite = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;  // padding rows: not part of the result
    for (int64_t c = 0; c < n; ++c) {
      double ref = 0, mag = 0, plain = 0;
      for (int64_t j = 0; j < k; ++j) {
        const double av = fp8::block_decode(qx[size_t(r * k + j)], sx[size_t(r * kb + j / 128)]);
        const size_t wi = size_t((e * n + c) * k + j);
        const double wv = fp8::block_decode(qw[wi], sw[size_t((e * (n / 128) + c / 128) * kb + j / 128)]);
        ref += av * wv;
        mag += std::fabs(av * wv);
        plain += double(float_of(x[size_t(r * k + j)])) * double(float_of(w[wi]));
      }
      const double got = float_of(y[size_t(r * n + c)]);
      if (!std::isfinite(got)) {
        ++nonfinite;
        continue;
      }
      worst = std::max(worst, std::fabs(got - ref) / mag);
      worst_bf16 = std::max(worst_bf16, std::fabs(got - plain) / mag);
    }
  }
  EXPECT_EQ(nonfinite, 0) << "unwritten or NaN outputs in token rows";
  EXPECT_LT(worst, 4e-3) << "vs the quantization-emulating reference, relative to sum |a w|";
  std::printf("[fp8 grouped] BLOCK_N %d k %lld n %lld: max |err| / sum |a w| = %.2e vs the quantized operands, %.2e vs the "
              "bf16 operands\n",
              block_n, (long long)k, (long long)n, worst, worst_bf16);
}

TEST(Fp8Grouped, BlockScaledMatchesTheQuantizedReference) {
  MOK_REQUIRE_GPUS(1);
  for (const int bn : {128, 256}) {
    run_case({200, 128, 0, 77}, 512, 384, bn);  // 384 columns: a 256-wide tile past the edge (TMA clips)
    run_case({300, 5}, 2048, 256, bn);
    run_case({129}, 128, 128, bn);
  }
}

TEST(Fp8Grouped, RefusesShapesItCannotScale) {
  mok::gemm::Fp8GroupedArgs a;
  int dummy = 0;
  a.a = a.w = a.y = &dummy;
  a.a_scales = a.w_scales = reinterpret_cast<const float*>(&dummy);
  a.experts = 1;
  a.k = 100;
  a.n = 128;
  EXPECT_THROW(mok::gemm::plan_fp8_grouped(a), mok::Error);
  a.k = 128;
  a.n = 64;
  EXPECT_THROW(mok::gemm::plan_fp8_grouped(a), mok::Error);
}

}  // namespace
