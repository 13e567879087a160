// The FP8 backward's weight gradient (gemm::plan_fp8_wgrad, Form::Fp8Wgrad) with its operands made
// on the GPU (gemm::quantize_fp8_token_blocks_t over the routed layout), against the spec: each
// expert's rows quantized per 128 x 1 block by the CPU spec (src/reference/fp8_quant.h), the
// product of the decoded values in fp64. Padding rows hold NaN (the quantizer must leave them out:
// a NaN would reach every gradient of its expert), rows and columns of different magnitudes make
// every scale matter, experts of 200, 128, 0, 77 and 300 rows make partial blocks, an empty
// expert (written 0) and several K blocks. The error allowed is relative to sum |a b| of each
// output (the tensor cores' FP8 accumulation over 128 rows and the bf16 output's rounding); the
// unquantized bf16 product is reported beside it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gemm/fp8_quantize.h"
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
namespace gemm = mok::gemm;

// Routed operand [rows, cols]: column c and row block scaled by 2^(c % 7 - 3 + (r / 128) % 3),
// NaN in padding rows.
std::vector<uint16_t> operand(const Routed& rt, int64_t cols, uint64_t seed) {
  std::vector<uint16_t> v = random_bf16(size_t(rt.rows * cols), seed);
  for (int64_t r = 0; r < rt.rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      uint16_t& x = v[size_t(r * cols + c)];
      x = rt.expert_of(r) < 0 ? uint16_t(0x7fc0) : bits_of(std::ldexp(float_of(x), int(c % 7) - 3 + int((r / 128) % 3)));
    }
  return v;
}

// The spec's values of expert e's rows of `v` [rows, cols]: quantized per 128 x 1 block over the
// expert's rows in order, decoded; [count, cols].
std::vector<double> spec_values(const std::vector<uint16_t>& v, int64_t cols, int64_t begin, int64_t count) {
  std::vector<double> out(size_t(count * cols));
  if (count == 0) return out;
  const fp8::BlockShape block{fp8::kBlock, 1};
  std::vector<uint8_t> q(out.size());
  std::vector<float> s(size_t(fp8::scale_count(count, cols, block)));
  fp8::quantize_blocked(reinterpret_cast<const mok::bf16*>(v.data()) + begin * cols, count, cols, block,
                        fp8::ScaleRule::Fp32, q.data(), s.data());
  for (int64_t r = 0; r < count; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[size_t(r * cols + c)] = fp8::block_decode(q[size_t(r * cols + c)], s[size_t((r / 128) * cols + c)]);
  return out;
}

// Both operands quantized on the GPU over the routed layout (rows = ld: the padded layout).
struct Operands {
  DevBuf a_t, a_s, b_t, b_s;
  Operands(const Routed& rt, const std::vector<uint16_t>& a, int64_t m_out, const std::vector<uint16_t>& b, int64_t n,
           const DevBuf& dte, const DevBuf& dbegin, const DevBuf& dcount)
      : a_t(size_t(m_out * rt.rows)), a_s(size_t(rt.rows / 128 * m_out) * 4), b_t(size_t(n * rt.rows)),
        b_s(size_t(rt.rows / 128 * n) * 4) {
    quantize(rt, a, m_out, b, n, dte, dbegin, dcount);
  }
  void quantize(const Routed& rt, const std::vector<uint16_t>& a, int64_t m_out, const std::vector<uint16_t>& b,
                int64_t n, const DevBuf& dte, const DevBuf& dbegin, const DevBuf& dcount);
  // The wgrad's arguments over these operands (dw_up, the error word left to the caller).
  gemm::Fp8WgradArgs args(const Routed& rt, int64_t m_out, int64_t n, int64_t experts, void* dw,
                          const DevBuf& dbegin, const DevBuf& dcount) const {
    gemm::Fp8WgradArgs w;
    w.a_t = a_t.p;
    w.a_scales = a_s.as<float>();
    w.b_t = b_t.p;
    w.b_scales = b_s.as<float>();
    w.dw = dw;
    w.m_out = m_out;
    w.n = n;
    w.experts = experts;
    w.rows_total = rt.rows;
    w.expert_row_begin = dbegin.as<int32_t>();
    w.expert_rows = dcount.as<int32_t>();
    return w;
  }
};
void Operands::quantize(const Routed& rt, const std::vector<uint16_t>& a, int64_t m_out, const std::vector<uint16_t>& b,
                        int64_t n, const DevBuf& dte, const DevBuf& dbegin, const DevBuf& dcount) {
  Operands& o = *this;
  DevBuf da(a.size() * 2), db(b.size() * 2);
  upload(da, a);
  upload(db, b);
  const gemm::RoutedSegments seg{dte.as<int32_t>(), dbegin.as<int32_t>(), dcount.as<int32_t>(), rt.num_m_tiles()};
  gemm::quantize_fp8_token_blocks_t(da.p, rt.rows, m_out, o.a_t.p, o.a_s.as<float>(), nullptr, seg);
  gemm::quantize_fp8_token_blocks_t(db.p, rt.rows, n, o.b_t.p, o.b_s.as<float>(), nullptr, seg);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
}

// split: m_out is a packed gate/up width (dw gets the gate rows, dw_up the up rows).
void run_case(const std::vector<int32_t>& counts, int64_t m_out, int64_t n, bool split, int block_n) {
  SCOPED_TRACE(testing::Message() << "m_out " << m_out << ", n " << n << (split ? ", gate/up" : "") << ", BLOCK_N "
                                  << block_n);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size());
  const std::vector<uint16_t> a = operand(rt, m_out, 3 + m_out), b = operand(rt, n, 7 + n);
  DevBuf dte(rt.tile_expert.size() * 4 + 4), dbegin(size_t(E) * 4), dcount(size_t(E) * 4), err(4);
  upload(dte, rt.tile_expert);
  upload(dbegin, rt.begin);
  upload(dcount, rt.counts);
  const Operands q(rt, a, m_out, b, n, dte, dbegin, dcount);
  const int64_t half = split ? m_out / 2 : m_out;
  DevBuf dw(size_t(E * half * n) * 2), dw_up(split ? size_t(E * half * n) * 2 : 2);
  MOK_ASSERT_CUDA(cudaMemset(dw.p, 0xff, dw.bytes));
  MOK_ASSERT_CUDA(cudaMemset(dw_up.p, 0xff, dw_up.bytes));
  MOK_ASSERT_CUDA(cudaMemset(err.p, 0, 4));
  gemm::Fp8WgradArgs args = q.args(rt, m_out, n, E, dw.p, dbegin, dcount);
  args.dw_up = split ? dw_up.p : nullptr;
  gemm::Options o;
  o.error = err.as<unsigned>();
  o.block_n = block_n;
  const gemm::Plan plan = gemm::plan_fp8_wgrad(args, o);
  EXPECT_EQ(plan.block_n, block_n);
  gemm::run(plan, nullptr);
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired or a segment was refused";
  const auto g0 = download<uint16_t>(dw, size_t(E * half * n));
  const auto g1 = split ? download<uint16_t>(dw_up, size_t(E * half * n)) : std::vector<uint16_t>{};
  double worst = 0, worst_bf16 = 0;
  int64_t nonfinite = 0, nonzero_empty = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = rt.begin[size_t(e)], count = counts[size_t(e)];
    const auto av = spec_values(a, m_out, begin, count), bv = spec_values(b, n, begin, count);
    for (int64_t i = 0; i < m_out; ++i) {
      // Output row i of the packed width: gate row i' in dw or up row i' in dw_up.
      int64_t row = i;
      const std::vector<uint16_t>* got_v = &g0;
      if (split) {
        const int64_t grp = i / (2 * gemm::kGateUpGroup), pos = i % (2 * gemm::kGateUpGroup);
        row = grp * gemm::kGateUpGroup + pos % gemm::kGateUpGroup;
        if (pos >= gemm::kGateUpGroup) got_v = &g1;
      }
      for (int64_t j = 0; j < n; ++j) {
        double ref = 0, mag = 0, plain = 0;
        for (int64_t r = 0; r < count; ++r) {
          const double p = av[size_t(r * m_out + i)] * bv[size_t(r * n + j)];
          ref += p;
          mag += std::fabs(p);
          plain += double(float_of(a[size_t((begin + r) * m_out + i)])) * double(float_of(b[size_t((begin + r) * n + j)]));
        }
        const double got = float_of((*got_v)[size_t((e * half + row) * n + j)]);
        if (!std::isfinite(got)) {
          ++nonfinite;
          continue;
        }
        if (count == 0) {
          nonzero_empty += got != 0.0;
          continue;
        }
        worst = std::max(worst, std::fabs(got - ref) / mag);
        worst_bf16 = std::max(worst_bf16, std::fabs(got - plain) / mag);
      }
    }
  }
  EXPECT_EQ(nonfinite, 0) << "unwritten or NaN gradients (padding rows leaking in?)";
  EXPECT_EQ(nonzero_empty, 0) << "an expert without rows must get a zero gradient";
  EXPECT_LT(worst, 4e-3) << "vs the quantization-emulating reference, relative to sum |a b|";
  std::printf("[fp8 wgrad] BLOCK_N %d m_out %lld n %lld%s: max |err| / sum |a b| = %.2e vs the quantized operands, "
              "%.2e vs the bf16 operands\n",
              block_n, (long long)m_out, (long long)n, split ? " gate/up" : "", worst, worst_bf16);
}

TEST(Fp8Wgrad, TokenBlockScaledMatchesTheQuantizedReference) {
  MOK_REQUIRE_GPUS(1);
  for (const int bn : {128, 256}) {
    run_case({200, 128, 0, 77, 300}, 256, 384, false, bn);  // n 384: a 256-wide tile past the edge
    run_case({200, 128, 0, 77, 300}, 256, 384, true, bn);
    run_case({1}, 128, 128, false, bn);
    run_case({700, 45}, 384, 256, true, bn);
    run_case({1300, 2100}, 128, 256, false, bn);  // 11 and 17 K blocks: both block accumulators' exits, the stagger
  }
}

// A segment with rows that does not begin on a 128-row block cannot use the blocks' scales: the
// error word names the site (the call's results are then undefined: the word also ends the waits
// still pending). An expert without rows is never misaligned, wherever its begin points: its
// gradient is 0 and no error is recorded.
TEST(Fp8Wgrad, MisalignedSegmentIsReported) {
  MOK_REQUIRE_GPUS(1);
  const Routed rt({128, 0, 100});
  const int64_t m_out = 128, n = 128, E = 3;
  const std::vector<uint16_t> a = operand(rt, m_out, 1), b = operand(rt, n, 2);
  DevBuf dte(rt.tile_expert.size() * 4), dbegin(size_t(E) * 4), dcount(size_t(E) * 4), err(4),
      dw(size_t(E * m_out * n) * 2);
  upload(dte, rt.tile_expert);
  upload(dbegin, rt.begin);
  upload(dcount, rt.counts);
  const Operands q(rt, a, m_out, b, n, dte, dbegin, dcount);
  const auto run = [&](const std::vector<int32_t>& begins) {
    upload(dbegin, begins);
    EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
    EXPECT_EQ(cudaSuccess, cudaMemset(dw.p, 0xff, dw.bytes));
    gemm::Options o;
    o.error = err.as<unsigned>();
    gemm::run(gemm::plan_fp8_wgrad(q.args(rt, m_out, n, E, dw.p, dbegin, dcount), o), nullptr);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return download<unsigned>(err, 1)[0];
  };
  // The empty expert's begin off the blocks: no error, its gradient 0, the others computed.
  EXPECT_EQ(run({0, 5, 128}), 0u) << "an empty expert was taken for a misaligned one";
  const auto g = download<uint16_t>(dw, size_t(E * m_out * n));
  int64_t nonzero = 0, nonfinite = 0;
  for (int64_t i = 0; i < m_out * n; ++i) {
    nonzero += g[size_t(m_out * n + i)] != 0 ? 1 : 0;
    nonfinite += !std::isfinite(float_of(g[size_t(i)])) + !std::isfinite(float_of(g[size_t(2 * m_out * n + i)]));
  }
  EXPECT_EQ(nonzero, 0) << "the empty expert's gradient is not 0";
  EXPECT_EQ(nonfinite, 0) << "the experts with rows were not computed";
  // A segment with rows off the blocks: named in the error word.
  EXPECT_EQ(run({0, 128, 136}), gemm::kSiteFp8Segment);
}

TEST(Fp8Wgrad, RefusesShapesItCannotScale) {
  gemm::Fp8WgradArgs a;
  alignas(16) static char some[64];  // (never dereferenced: refused before any launch)
  a.a_t = a.b_t = a.dw = some;
  a.a_scales = a.b_scales = reinterpret_cast<const float*>(some);
  a.expert_row_begin = a.expert_rows = reinterpret_cast<const int32_t*>(some);
  a.m_out = 128;
  a.n = 128;
  a.experts = 1;
  a.rows_total = 128;
  const auto refused = [](const gemm::Fp8WgradArgs& x, const gemm::Options& o, const char* arg) {
    try {
      gemm::plan_fp8_wgrad(x, o);
      ADD_FAILURE() << "accepted, expected a refusal naming " << arg;
    } catch (const mok::Error& e) {
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
  };
  gemm::Fp8WgradArgs b = a;
  b.m_out = 192;
  refused(b, {}, "fp8_wgrad.m_out");
  b = a;
  b.n = 64;
  refused(b, {}, "fp8_wgrad.n");
  b = a;
  b.expert_rows = nullptr;
  refused(b, {}, "fp8_wgrad");
  b = a;
  b.b_scales = reinterpret_cast<const float*>(some + 4);
  refused(b, {}, "fp8_wgrad.a_scales, b_scales");
  gemm::Options o;
  o.block_n = 64;
  refused(a, o, "options.block_n");
}

}  // namespace
