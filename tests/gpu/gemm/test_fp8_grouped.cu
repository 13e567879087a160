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
#include <cstring>
#include <utility>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "gemm/swiglu_math.cuh"
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

void run_case(const std::vector<int32_t>& counts, int64_t k, int64_t n, int block_n, int skew = 0, int max_ctas = 0) {
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
  o.skew_stages = skew;
  o.max_ctas = max_ctas;  // few CTAs: each runs several staggered tiles (both skew barriers, both phases)
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
    run_case({300, 5}, 2048, 256, bn, 2, 1);  // the warpgroup stagger, 4+ tiles per CTA: the same results
    run_case({300, 5}, 2048, 256, bn, 3, 2);
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

// h exactly as FC1's epilogue makes it, from the gate/up rows it stored (Fp8Fc1Args::gu: the
// epilogue's own rnd(g), rnd(u)): rnd(swiglu_of_bf16(g, u)), the same device function and the
// same rounding instruction. Quantized by the CPU spec, these h values give the codes and scales
// the epilogue must have written, bit for bit (the accumulation-order noise is in g and u, which
// both sides share).
__global__ void h_from_gu_kernel(const uint16_t* gu, int64_t rows, int64_t inter, uint16_t* h) {
  const int64_t n = rows * inter;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = x / inter, i = x % inter, pg = (i / 32) * 64 + i % 32;  // packed: 32 gates, their 32 ups
    const float g = __uint_as_float(uint32_t(gu[r * 2 * inter + pg]) << 16);
    const float u = __uint_as_float(uint32_t(gu[r * 2 * inter + pg + 32]) << 16);
    uint16_t b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(mok::gemm::swiglu_of_bf16(g, u)));
    h[x] = b;
  }
}

// FC1 in FP8 (gemm::plan_fp8_fc1): x and both weights quantized by the CPU spec; the reference is
// g, u in fp64 from the decoded operands, rounded to bf16, h = rnd(silu(g) u), quantized per 1 x 128
// by the spec. The GPU differs by accumulation order (and the SFU's exp in silu), so an h code may
// land one E4M3 step off where the reference sits near a rounding boundary: the test demands
// every scale within 2^-6 (a row maximum that moved by up to two bf16 steps, a step being up to
// 2^-7 relative: measured 1.05e-2 on an H200), the decoded h within 2% in norm, and reports how
// many codes are exactly the reference's. The stored gate/up rows (Fp8Fc1Args::gu) are checked
// against the reference's rnd(g), rnd(u) the same way (norm, and most exactly).
// h_mx: h as MXFP8 re-blocked to 1 x 128 (Fp8Fc1Args::h_mx), the reference's h quantized by
// quantize_mxfp8 + reblock_mxfp8; its power-of-two scales either match or are a factor 2 off where
// a 32-column block's maximum sits at a binade boundary, so the scale bound is a count there.
void run_fc1_case(const std::vector<int32_t>& counts, int64_t H, int64_t I, int skew = 0, int max_ctas = 0,
                  bool h_mx = false) {
  SCOPED_TRACE(testing::Message() << "H " << H << ", I " << I << ", skew " << skew << (h_mx ? ", h as MXFP8" : ""));
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, kb = H / 128, ib = I / 128;
  std::vector<uint16_t> x = random_bf16(size_t(rows * H), 17 + H);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < H; ++c) {
      uint16_t& v = x[size_t(r * H + c)];
      v = rt.expert_of(r) < 0 ? uint16_t(0) : bits_of(std::ldexp(float_of(v), int(r % 7) - 3));
    }
  const std::vector<uint16_t> wg = random_bf16(size_t(E * I * H), 19 + I, 0.05), wu = random_bf16(size_t(E * I * H), 23 + I, 0.05);
  std::vector<uint8_t> qx(x.size()), qg(wg.size()), qu(wu.size());
  std::vector<float> sx(size_t(rows * kb)), sg(size_t(E * ib * kb)), su(sg.size());
  fp8::quantize_1x128(reinterpret_cast<const mok::bf16*>(x.data()), rows, H, qx.data(), sx.data());
  for (int64_t e = 0; e < E; ++e) {
    fp8::quantize_128x128(reinterpret_cast<const mok::bf16*>(wg.data()) + e * I * H, I, H, qg.data() + e * I * H,
                          sg.data() + e * ib * kb);
    fp8::quantize_128x128(reinterpret_cast<const mok::bf16*>(wu.data()) + e * I * H, I, H, qu.data() + e * I * H,
                          su.data() + e * ib * kb);
  }
  DevBuf dqx(qx.size()), dsx(sx.size() * 4), dqg(qg.size()), dsg(sg.size() * 4), dqu(qu.size()), dsu(su.size() * 4),
      dh(size_t(rows * I)), dsh(size_t(rows * ib) * 4), dte(rt.tile_expert.size() * 4 + 4), err(4),
      dgu(size_t(rows * 2 * I) * 2);
  upload(dqx, qx);
  upload(dsx, sx);
  upload(dqg, qg);
  upload(dsg, sg);
  upload(dqu, qu);
  upload(dsu, su);
  upload(dte, rt.tile_expert);
  MOK_ASSERT_CUDA(cudaMemset(dh.p, 0x7f, dh.bytes));  // NaN codes: an unwritten h shows
  MOK_ASSERT_CUDA(cudaMemset(dsh.p, 0xff, dsh.bytes));
  MOK_ASSERT_CUDA(cudaMemset(dgu.p, 0xff, dgu.bytes));  // NaN bf16: an unwritten gate/up value shows
  MOK_ASSERT_CUDA(cudaMemset(err.p, 0, 4));
  mok::gemm::Fp8Fc1Args a;
  a.x = dqx.p;
  a.x_scales = dsx.as<float>();
  a.w_gate = dqg.p;
  a.w_gate_scales = dsg.as<float>();
  a.w_up = dqu.p;
  a.w_up_scales = dsu.as<float>();
  a.h = dh.p;
  a.h_scales = dsh.as<float>();
  a.gu = dgu.p;
  a.hidden = H;
  a.inter = I;
  a.experts = E;
  a.tile_expert = dte.as<int32_t>();
  a.num_m_tiles = rt.num_m_tiles();
  a.h_mx = h_mx;
  mok::gemm::Options o;
  o.error = err.as<unsigned>();
  o.skew_stages = skew;  // the warpgroup stagger (applies to tiles of more than 4 + skew K blocks)
  o.max_ctas = max_ctas;
  mok::gemm::run(mok::gemm::plan_fp8_fc1(a, o), nullptr);
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  const auto gh = download<uint8_t>(dh, size_t(rows * I));
  const auto gs = download<float>(dsh, size_t(rows * ib));
  const auto ggu = download<uint16_t>(dgu, size_t(rows * 2 * I));
  DevBuf dhx(size_t(rows * I) * 2);  // h from the stored gate/up rows, as the epilogue made it
  h_from_gu_kernel<<<256, 256>>>(dgu.as<uint16_t>(), rows, I, dhx.as<uint16_t>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto hx = download<uint16_t>(dhx, size_t(rows * I));
  int64_t exact_bad = 0;  // codes or scales that differ from the spec's quantization of that h
  double d2 = 0, r2 = 0, worst_scale = 0, gu_d2 = 0, gu_r2 = 0;
  int64_t same = 0, compared = 0, gu_same = 0, gu_bad = 0, scale_off = 0, scales_seen = 0;
  const auto rnd = [](double v) { return double(float_of(bits_of(float(v)))); };
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    std::vector<float> h(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t j = 0; j < H; ++j) {
        const double xv = fp8::block_decode(qx[size_t(r * H + j)], sx[size_t(r * kb + j / 128)]);
        const size_t wi = size_t((e * I + i) * H + j), si = size_t((e * ib + i / 128) * kb + j / 128);
        g += xv * fp8::block_decode(qg[wi], sg[si]);
        u += xv * fp8::block_decode(qu[wi], su[si]);
      }
      g = rnd(g);
      u = rnd(u);
      h[size_t(i)] = float(rnd(g / (1.0 + std::exp(-g)) * u));
      // The stored gate/up pair (packed order: per 64 columns, 32 gates then their 32 ups).
      const int64_t pg = (i / 32) * 64 + i % 32;
      for (const auto& [col, want] : {std::pair<int64_t, double>{pg, g}, std::pair<int64_t, double>{pg + 32, u}}) {
        const double got = float_of(ggu[size_t(r * 2 * I + col)]);
        if (!std::isfinite(got)) ++gu_bad;
        gu_d2 += (got - want) * (got - want);
        gu_r2 += want * want;
        gu_same += got == want;
      }
    }
    // One row of h quantized by the spec (1 x 128, or MX re-blocked to 1 x 128).
    const auto quantize_row = [&](const std::vector<float>& v, std::vector<uint8_t>& q, std::vector<float>& sc) {
      q.assign(static_cast<size_t>(I), 0);
      sc.assign(static_cast<size_t>(ib), 0.0f);
      if (h_mx) {
        std::vector<uint8_t> mq(static_cast<size_t>(I)), ms(static_cast<size_t>(I / 32));
        fp8::quantize_mxfp8(v.data(), 1, I, mq.data(), ms.data());
        fp8::reblock_mxfp8(mq.data(), ms.data(), 1, I, fp8::kActivationBlock, q.data(), sc.data());
      } else {
        fp8::quantize_1x128(v.data(), 1, I, q.data(), sc.data());
      }
    };
    {  // bit for bit: the spec's quantization of the epilogue's own h values
      std::vector<float> hv(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) hv[size_t(i)] = float_of(hx[size_t(r * I + i)]);
      std::vector<uint8_t> q;
      std::vector<float> sc;
      quantize_row(hv, q, sc);
      for (int64_t i = 0; i < I; ++i) exact_bad += q[size_t(i)] != gh[size_t(r * I + i)];
      for (int64_t b = 0; b < ib; ++b)  // (fp32 bits: a NaN scale equals a NaN scale)
        exact_bad += std::memcmp(&sc[size_t(b)], &gs[size_t(r * ib + b)], 4) != 0;
    }
    std::vector<uint8_t> qh;
    std::vector<float> sh;
    quantize_row(h, qh, sh);  // the fp64 reference's h
    for (int64_t b = 0; b < ib; ++b) {
      const double ratio = double(gs[size_t(r * ib + b)]) / sh[size_t(b)];
      ++scales_seen;
      if (h_mx && std::isfinite(ratio) && ratio != 1.0) {
        scale_off += 1;
        if (ratio != 2.0 && ratio != 0.5) worst_scale = INFINITY;  // a power of two off by more than one
        continue;
      }
      worst_scale = std::isfinite(ratio) ? std::max(worst_scale, std::fabs(ratio - 1.0)) : INFINITY;  // unwritten: NaN
    }
    for (int64_t i = 0; i < I; ++i) {
      const double want = fp8::block_decode(qh[size_t(i)], sh[size_t(i / 128)]);
      const double got = fp8::block_decode(gh[size_t(r * I + i)], gs[size_t(r * ib + i / 128)]);
      d2 += (got - want) * (got - want);
      r2 += want * want;
      same += gh[size_t(r * I + i)] == qh[size_t(i)];
      ++compared;
    }
  }
  const double rel = std::sqrt(d2 / std::max(r2, 1e-300)), gu_rel = std::sqrt(gu_d2 / std::max(gu_r2, 1e-300));
  // The gate/up rows (Fp8Fc1Args::gu): rnd of the same accumulators, so an element is the
  // reference's or a bf16 step off where the tensor cores' accumulation (about 14 bits inside a
  // 128-deep block, DeepSeek-V3's measurement) moved it across a rounding boundary: a few percent
  // of the elements, each 2^-8 relative, hence the bounds (not yet measured: to tighten after the
  // first run).
  EXPECT_EQ(gu_bad, 0) << "gate/up values not written (NaN)";
  EXPECT_EQ(exact_bad, 0) << "h codes / scales differ from the spec's quantization of the epilogue's own h";
  EXPECT_LT(gu_rel, 4e-3) << "stored gate/up vs the reference, in norm";
  EXPECT_GT(double(gu_same), 0.75 * double(2 * compared)) << "most gate/up values must be the reference's exactly";
  EXPECT_LE(worst_scale, 0x1p-6) << "h scales vs the reference (two bf16 steps; MX: a binade at most)";
  EXPECT_LE(double(scale_off), 0.01 * double(scales_seen)) << "MX h scales a binade off the reference's";
  EXPECT_LT(rel, 2e-2) << "decoded h vs the reference, in norm";
  EXPECT_GT(double(same), 0.9 * double(compared)) << "most codes must be the reference's exactly";
  std::printf("[fp8 fc1] H %lld I %lld: h scales within %.1e, decoded h %.2e in norm, %.2f%% of the codes exact; "
              "gate/up %.2e in norm, %.2f%% exact\n",
              (long long)H, (long long)I, worst_scale, rel, 100.0 * double(same) / double(compared), gu_rel,
              50.0 * double(gu_same) / double(compared));
}

TEST(Fp8Grouped, Fc1WithQuantizedHMatchesTheReference) {
  MOK_REQUIRE_GPUS(1);
  run_fc1_case({200, 0, 77}, 512, 256);
  run_fc1_case({130}, 256, 384);
  run_fc1_case({130, 60}, 1024, 256, 2, 1);  // 8 K blocks: warpgroup 1 two behind, 6 tiles in one CTA
}

// FC1 with h as MXFP8 re-blocked to 1 x 128 (Fp8Fc1Args::h_mx).
TEST(Fp8Grouped, Fc1WithMxHMatchesTheReference) {
  MOK_REQUIRE_GPUS(1);
  run_fc1_case({200, 0, 77}, 512, 256, 0, 0, true);
  run_fc1_case({130, 60}, 1024, 256, 2, 1, true);
}

}  // namespace
