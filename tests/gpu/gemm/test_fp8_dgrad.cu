// The FP8 backward's dgrads (issue 22, recipe 1) with their operands made on the GPU:
//   - weights: gemm::transpose_weights_bf16 + quantize_fp8_blocked(128) give W_down^T's codes and
//     scales equal to the spec's 128 x 128 quantization of W_down transposed (the forward's blocks),
//     and [W_gate; W_up]^T in the packed K order equal to the spec's quantization of the packed
//     matrix transposed, bit for bit;
//   - FC2's dgrad + SwiGLU' (gemm::plan_fp8_dgrad_swiglu) over unweighted rows with router
//     weights: d_gu against the formula on the host from g = the decoded operands' product in
//     fp64 (norm-relative), the router-weight partial sums against <g, h> in fp64, and h written
//     rnd(w * rnd(silu(g) u)) bit for bit (the epilogue is the bf16 form's); two runs the same bits;
//   - FC1's dgrad: d_gu quantized per 1 x 128 (quantize_fp8_blocked) and the plain FP8 form with
//     the packed transposed weights, against the decoded codes' product in fp64.
// Padding rows hold NaN in every input.
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

using namespace mok::test;
namespace fp8 = mok::fp8;
namespace gemm = mok::gemm;

// The spec's 128 x 128 codes and scales of each expert's [rows, cols] matrix (experts stacked).
void spec_weights(const std::vector<uint16_t>& w, int64_t E, int64_t rows, int64_t cols, std::vector<uint8_t>& q,
                  std::vector<float>& s) {
  q.resize(w.size());
  s.resize(size_t(E * (rows / 128) * (cols / 128)));
  for (int64_t e = 0; e < E; ++e)
    fp8::quantize_128x128(reinterpret_cast<const mok::bf16*>(w.data()) + e * rows * cols, rows, cols,
                          q.data() + e * rows * cols, s.data() + e * (rows / 128) * (cols / 128));
}

// Host transpose of each expert's [rows, cols]; with up: the packed gate/up order along the new K.
std::vector<uint16_t> host_transposed(const std::vector<uint16_t>& w, const std::vector<uint16_t>* up, int64_t E,
                                      int64_t rows, int64_t cols) {
  const int64_t k = up ? 2 * rows : rows;
  std::vector<uint16_t> t(size_t(E * cols * k));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t at = size_t(e * rows * cols + r * cols + c);
        if (up == nullptr) {
          t[size_t(e * cols * k + c * k + r)] = w[at];
        } else {
          t[size_t(e * cols * k + c * k + gemm::packed_gate_row(r))] = w[at];
          t[size_t(e * cols * k + c * k + gemm::packed_up_row(r))] = (*up)[at];
        }
      }
  return t;
}

// GPU: the transposed weights quantized per 128 x 128; checked against the spec, returned as
// device codes and scales.
void gpu_weights_t(const std::vector<uint16_t>& w, const std::vector<uint16_t>* up, int64_t E, int64_t rows,
                   int64_t cols, DevBuf& q, DevBuf& s, std::vector<uint8_t>& want_q, std::vector<float>& want_s) {
  const int64_t k = up ? 2 * rows : rows;
  DevBuf dw(w.size() * 2), dup(up ? up->size() * 2 : 2), dt(size_t(E * cols * k) * 2);
  upload(dw, w);
  if (up) upload(dup, *up);
  gemm::transpose_weights_bf16(dw.p, up ? dup.p : nullptr, E, rows, cols, dt.p, nullptr);
  gemm::quantize_fp8_blocked(dt.p, E * cols, k, 128, fp8::ScaleRule::Fp32, q.p, s.as<float>(), nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  spec_weights(host_transposed(w, up, E, rows, cols), E, cols, k, want_q, want_s);
  EXPECT_EQ(count_diff(download<uint8_t>(q, want_q.size()), want_q), 0) << "transposed weight codes differ";
  EXPECT_EQ(count_diff(download<float>(s, want_s.size()), want_s), 0) << "transposed weight scales differ";
}

void check_case(const std::vector<int32_t>& counts, int64_t H, int64_t I, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "H=" << H << " I=" << I);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, n2 = 2 * I, parts = gemm::router_parts(I);
  const auto d = routed_input(rt, H, seed), gu = routed_input(rt, n2, seed + 1);
  const auto wd = random_bf16(size_t(E * H * I), seed + 2, 0.05), wg = random_bf16(size_t(E * I * H), seed + 3, 0.05),
             wu = random_bf16(size_t(E * I * H), seed + 4, 0.05);
  std::vector<float> weight(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) weight[size_t(r)] = rt.expert_of(r) < 0 ? 0.0f : float((r * 37) % 11) / 10.0f;
  // Weights: W_down^T [E, I, H] and [W_gate; W_up]^T [E, H, 2I] (packed K), quantized on the GPU.
  DevBuf qwd(size_t(E * H * I)), swd(size_t(E * H * I / 16384) * 4), qw1(size_t(E * 2 * I * H)),
      sw1(size_t(E * 2 * I * H / 16384) * 4);
  std::vector<uint8_t> wd_q, w1_q;
  std::vector<float> wd_s, w1_s;
  gpu_weights_t(wd, nullptr, E, H, I, qwd, swd, wd_q, wd_s);
  gpu_weights_t(wg, &wu, E, I, H, qw1, sw1, w1_q, w1_s);
  // d_y per 1 x 128 on the GPU (its codes are the spec's: Fp8Quantize tests).
  DevBuf dd(d.size() * 2), dq(d.size()), ds(size_t(rows * H / 128) * 4), dgu(gu.size() * 2), dte(rt.tile_expert.size() * 4),
      dweight(weight.size() * 4);
  upload(dd, d);
  upload(dgu, gu);
  upload(dte, rt.tile_expert);
  upload(dweight, weight);
  gemm::quantize_fp8_blocked(dd.p, rows, H, 1, fp8::ScaleRule::Fp32, dq.p, ds.as<float>(), nullptr);
  const auto d_q = [&] {
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return download<uint8_t>(dq, d.size());
  }();
  const auto d_s = download<float>(ds, size_t(rows * H / 128));
  const auto run = [&](std::vector<uint16_t>& d_gu, std::vector<uint16_t>& h, std::vector<float>& partial) {
    DevBuf out(gu.size() * 2), dh(size_t(rows * I) * 2), dpart(size_t(rows * parts) * 4), err(4);
    EXPECT_EQ(cudaSuccess, cudaMemset(dpart.p, 0xFF, dpart.bytes));  // (padding rows' sums: never written)
    EXPECT_EQ(cudaSuccess, cudaMemset(out.p, 0xFF, out.bytes));
    EXPECT_EQ(cudaSuccess, cudaMemset(dh.p, 0xFF, dh.bytes));
    EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
    gemm::Fp8DgradSwiGLUArgs a;
    a.dy = dq.p, a.dy_scales = ds.as<float>(), a.w_down_t = qwd.p, a.w_down_t_scales = swd.as<float>();
    a.gu = dgu.p, a.d_gu = out.p, a.hidden = H, a.inter = I, a.experts = E;
    a.tile_expert = dte.as<int32_t>(), a.num_m_tiles = rt.num_m_tiles();
    a.row_weight = dweight.as<float>(), a.router_partial = dpart.as<float>(), a.h = dh.p;
    gemm::Options o;
    o.error = err.as<unsigned>();
    gemm::run(gemm::plan_fp8_dgrad_swiglu(a, o), nullptr);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
    d_gu = download<uint16_t>(out, gu.size());
    h = download<uint16_t>(dh, size_t(rows * I));
    partial = download<float>(dpart, size_t(rows * parts));
  };
  std::vector<uint16_t> d_gu, h, d_gu2, h2;
  std::vector<float> partial, partial2;
  run(d_gu, h, partial);
  run(d_gu2, h2, partial2);
  EXPECT_TRUE(d_gu == d_gu2 && h == h2 && count_diff(partial, partial2) == 0) << "a second run gave other bits";
  ErrStat gerr;
  double router_worst = 0;
  int64_t h_diff = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    const float wr = weight[size_t(r)];
    double dot = 0, mag = 0;
    for (int64_t i = 0; i < I; ++i) {
      double g = 0;  // d_y . W_down[:, i] of the decoded codes (W_down^T's row i)
      for (int64_t k = 0; k < H; ++k)
        g += fp8::block_decode(d_q[size_t(r * H + k)], d_s[size_t(r * (H / 128) + k / 128)]) *
             fp8::block_decode(wd_q[size_t((e * I + i) * H + k)], wd_s[size_t((e * (I / 128) + i / 128) * (H / 128) + k / 128)]);
      const size_t pg = size_t(r * n2 + gemm::packed_gate_row(i)), pu = size_t(r * n2 + gemm::packed_up_row(i));
      const double gf = float_of(gu[pg]), uf = float_of(gu[pu]), sf = 1.0 / (1.0 + std::exp(-gf));
      const double hb = float_of(bits_of(float(gf * sf * uf)));
      const double dh = wr * g;
      gerr.add(float_of(d_gu[pg]), sf * (1.0 + gf * (1.0 - sf)) * uf * dh);
      gerr.add(float_of(d_gu[pu]), gf * sf * dh);
      dot += g * hb;
      mag += std::fabs(g * hb);
      h_diff += bf16_steps_apart(h[size_t(r * I + i)], bits_of(float(wr * hb))) > 1;
    }
    double sum = 0;
    for (int64_t q = 0; q < parts; ++q) sum += partial[size_t(r * parts + q)];
    router_worst = std::max(router_worst, std::fabs(sum - dot) / std::max(mag, 1e-30));
  }
  EXPECT_EQ(gerr.nonfinite, 0) << "unwritten or NaN d_gu in token rows";
  EXPECT_LT(gerr.rel(), 5e-3) << "d_gu vs the formula from the decoded operands' product (norm-relative)";
  EXPECT_LT(router_worst, 5e-3) << "router-weight gradient vs <g, h> from the decoded operands (relative to sum |g h|)";
  EXPECT_EQ(h_diff, 0) << "h not written rnd(w * rnd(silu(g) u)) (within the SFU's step)";
  // FC1's dgrad: d_gu per 1 x 128 (packed order) times the packed transposed weights.
  DevBuf gq(gu.size()), gs(size_t(rows * n2 / 128) * 4), gdu(gu.size() * 2), dx(size_t(rows * H) * 2), err(4);
  upload(gdu, d_gu);
  gemm::quantize_fp8_blocked(gdu.p, rows, n2, 1, fp8::ScaleRule::Fp32, gq.p, gs.as<float>(), nullptr);
  EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
  gemm::Fp8GroupedArgs f;
  f.a = gq.p, f.a_scales = gs.as<float>(), f.w = qw1.p, f.w_scales = sw1.as<float>(), f.y = dx.p;
  f.k = n2, f.n = H, f.experts = E, f.tile_expert = dte.as<int32_t>(), f.num_m_tiles = rt.num_m_tiles();
  gemm::Options o;
  o.error = err.as<unsigned>();
  gemm::run(gemm::plan_fp8_grouped(f, o), nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u);
  const auto g_q = download<uint8_t>(gq, gu.size());
  const auto g_s = download<float>(gs, size_t(rows * n2 / 128));
  const auto x = download<uint16_t>(dx, size_t(rows * H));
  double worst = 0;
  int64_t nonfinite = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    for (int64_t c = 0; c < H; c += 7) {  // every 7th column: enough to catch a layout or scale error
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < n2; ++k) {
        const double p = fp8::block_decode(g_q[size_t(r * n2 + k)], g_s[size_t(r * (n2 / 128) + k / 128)]) *
                         fp8::block_decode(w1_q[size_t((e * H + c) * n2 + k)],
                                           w1_s[size_t((e * (H / 128) + c / 128) * (n2 / 128) + k / 128)]);
        ref += p;
        mag += std::fabs(p);
      }
      const double got = float_of(x[size_t(r * H + c)]);
      if (!std::isfinite(got)) {
        ++nonfinite;
        continue;
      }
      worst = std::max(worst, std::fabs(got - ref) / std::max(mag, 1e-30));
    }
  }
  EXPECT_EQ(nonfinite, 0);
  EXPECT_LT(worst, 4e-3) << "FC1's FP8 dgrad vs the decoded codes' product (relative to sum |a w|)";
  std::printf("[fp8 dgrad] rows %lld H %lld I %lld: d_gu %.2e (norm), router %.2e, FC1 dgrad %.2e\n", (long long)rows,
              (long long)H, (long long)I, gerr.rel(), router_worst, worst);
}

TEST(Fp8Dgrad, SwiGLUAndFc1MatchTheQuantizedReference) {
  MOK_REQUIRE_GPUS(1);
  check_case({0, 1, 63, 128, 200}, 256, 128, 11);
  check_case({300, 0, 77}, 512, 384, 12);  // I = 384: a 256-wide tile past the edge
}

TEST(Fp8Dgrad, RefusesShapesItCannotScale) {
  gemm::Fp8DgradSwiGLUArgs a;
  static char some[256];  // (never dereferenced: refused before any launch)
  a.dy = a.w_down_t = a.gu = some;
  a.d_gu = some + 64;
  a.dy_scales = a.w_down_t_scales = reinterpret_cast<const float*>(some);
  a.hidden = 256;
  a.inter = 192;
  a.experts = 1;
  try {
    gemm::plan_fp8_dgrad_swiglu(a, {});
    ADD_FAILURE() << "inter 192 accepted";
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_dgrad_swiglu.inter"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gemm::transpose_weights_bf16(some, nullptr, 1, 48, 64, some, nullptr), mok::Error);
}

}  // namespace
