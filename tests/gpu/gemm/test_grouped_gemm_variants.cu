// Grouped GEMM forms that extend a plain one, each checked on the same GPU against the plain form
// it extends: FC2's dgrad fused with the SwiGLU backward (also against fp64) and the weight
// gradient accumulating into fp32. The plain forms and the tile options are in
// test_grouped_gemm.cu; the cases here run in the same frame (grouped_gemm_cases.h): random bf16
// inputs with NaN padding rows, outputs poisoned before each run, two runs bitwise equal.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "grouped_gemm_cases.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"

namespace {

using namespace mok::test;           // DevBuf, Routed, routed_input, ErrStat, ... (gemm_test_util.h)
using namespace mok::test::grouped;  // Device, run_twice, g_block_n, ... (grouped_gemm_cases.h)
namespace gemm = mok::gemm;

// ---------------------------------------------------------------------------------------------
// FC2's dgrad fused with the SwiGLU backward: d_gu[r] (packed) from d_h = rnd(dy[r] . W[e]) and gu[r]
// ---------------------------------------------------------------------------------------------
// Three checks per case: (1) against fp64 (d_h rounded to bf16 as the reference does, then the
// reference's formula), relative error <= 1e-2 over the checked columns of every real row, no
// unwritten output; (2) against the unfused path on the same GPU (plan_dgrad's d_h bits, then the
// formula on the host in fp32, uncontracted as in the kernel): every element within one bf16
// step, since both runs make the same fp32 sums in the same order and differ only in the SFU's
// exp and division; this pins the packed index mapping to the element; (3) in place (d_gu = gu)
// gives the same bits. Two runs are bitwise equal. Padding rows of dy and gu hold NaN.
void dswiglu_case(const std::vector<int32_t>& counts, int64_t hidden, int64_t inter, int max_ctas, uint64_t seed,
                  int check_cols_stride = 1, int skew = 0) {
  SCOPED_TRACE(testing::Message() << "dgrad+swiglu hidden=" << hidden << " inter=" << inter << " ctas=" << max_ctas
                                  << " skew=" << skew << " bn=" << g_block_n << " cluster=" << g_cluster);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, n2 = 2 * inter;
  const auto dy = routed_input(rt, hidden, seed);
  const auto w = random_bf16(size_t(E * hidden * inter), seed + 1, 0.05);  // [E, hidden, inter]
  const auto gu = routed_input(rt, n2, seed + 2);                          // packed gate/up
  DevBuf ddy(dy.size() * 2), dw(w.size() * 2), dgu(gu.size() * 2), dte(rt.tile_expert.size() * 4 + 4),
      dout(size_t(rows * n2) * 2), ddh(size_t(rows * inter) * 2), dip(gu.size() * 2);
  upload(ddy, dy);
  upload(dw, w);
  upload(dgu, gu);
  upload(dip, gu);
  upload(dte, rt.tile_expert);
  Device dev;
  dev.skew = skew;
  dev.block_n = g_block_n;
  gemm::DgradSwiGLUArgs a{.dy = ddy.p, .w_down = dw.p, .gu = dgu.p, .d_gu = dout.p, .hidden = hidden, .inter = inter,
                          .experts = E, .tile_expert = dte.as<int32_t>(), .num_m_tiles = rt.num_m_tiles()};
  const gemm::Plan plan = gemm::plan_dgrad_swiglu(a, dev.opts(max_ctas));
  std::vector<std::vector<uint16_t>> r1, r2;
  std::vector<DevBuf*> outs{&dout};
  run_twice(plan, dev, outs, r1, r2);
  const auto& got = r1[0];

  const gemm::DgradArgs g{.dy = ddy.p, .w = dw.p, .dx = ddh.p, .k = hidden, .n = inter, .experts = E,
                          .tile_expert = dte.as<int32_t>(), .num_m_tiles = rt.num_m_tiles()};
  const gemm::Plan plan_dh = gemm::plan_dgrad(g, dev.opts(max_ctas));
  ASSERT_EQ(plan_dh.block_n, plan.block_n);
  gemm::run(plan_dh, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u);
  const auto dh = download<uint16_t>(ddh, size_t(rows * inter));

  a.gu = dip.p;
  a.d_gu = dip.p;
  gemm::run(gemm::plan_dgrad_swiglu(a, dev.opts(max_ctas)), nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u);
  const auto in_place = download<uint16_t>(dip, size_t(rows * n2));

  const auto dyd = to_double(dy), wd = to_double(w);
  ErrStat st;
  int64_t far = 0, exact = 0, compared = 0, in_place_diff = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    for (int64_t i = 0; i < inter; ++i) {
      const size_t pg = size_t(r * n2 + gemm::packed_gate_row(i)), pu = size_t(r * n2 + gemm::packed_up_row(i));
      in_place_diff += (in_place[pg] != got[pg]) + (in_place[pu] != got[pu]);
      // (2) the unfused d_h, every element.
      const float dhf = float_of(dh[size_t(r * inter + i)]), gf = float_of(gu[pg]), uf = float_of(gu[pu]);
      const float sf = 1.0f / (1.0f + std::exp(-gf));
      const int sg = bf16_steps_apart(got[pg], bits_of(sf * (1.0f + gf * (1.0f - sf)) * uf * dhf));
      const int su = bf16_steps_apart(got[pu], bits_of(gf * sf * dhf));
      far += (sg > 1) + (su > 1);
      exact += (sg == 0) + (su == 0);
      compared += 2;
      // (1) fp64, every check_cols_stride-th column.
      if (i % check_cols_stride != 0) continue;
      double acc = 0;
      for (int64_t k = 0; k < hidden; ++k) acc += dyd[size_t(r * hidden + k)] * wd[size_t((e * hidden + k) * inter + i)];
      const double dhr = float_of(bits_of(float(acc))), gd = gf, ud = uf;
      const double s = 1.0 / (1.0 + std::exp(-gd));
      st.add(float_of(got[pg]), s * (1.0 + gd * (1.0 - s)) * ud * dhr);
      st.add(float_of(got[pu]), gd * s * dhr);
    }
  }
  EXPECT_EQ(st.nonfinite, 0) << "unwritten or NaN outputs in real rows";
  EXPECT_LE(st.rel(), kTol);
  EXPECT_EQ(far, 0) << "elements more than one bf16 step from the unfused d_h + SwiGLU backward";
  EXPECT_EQ(in_place_diff, 0) << "in place (d_gu = gu) changed bits";
  EXPECT_EQ(plan.block_n, g_block_n);
  std::printf("[dgrad+swiglu bn=%d%s] rows=%lld H=%lld I=%lld ctas=%d  rel err %.2e (checked %lld); vs unfused: "
              "%lld of %lld equal, %lld one step apart\n",
              plan.block_n, g_cluster ? " cluster" : "", (long long)rows, (long long)hidden, (long long)inter, plan.grid,
              st.rel(), (long long)st.count, (long long)exact, (long long)compared, (long long)(compared - exact - far));
}

// I = 200 and 232: the last N tile is partial (at BLOCK_N 256 chunk 6 is partly past 2I and
// chunk 7 wholly; at 128 the second tile holds 72 or 104 columns); K = 328 is not a multiple of
// 64; experts with 0, 1, 63, 128, 200 and 385 rows; few CTAs and all SMs; the consumer stagger;
// both tile widths, with and without 2-CTA clusters.
TEST(GroupedGemm, DgradSwiGLUFusedBackward) {
  MOK_REQUIRE_GPUS(1);
  for (bool cluster : {false, true}) {
    g_cluster = cluster;
    for (int bn : {256, 128}) {
      g_block_n = bn;
      dswiglu_case({0, 1, 63, 128, 200, 385}, 328, 160, 5, 801);
      dswiglu_case({0, 1, 63, 128, 200, 385}, 328, 224, 0, 802);
      dswiglu_case({512, 300, 0, 1000, 17}, 1024, 512, 7, 803, 7, 2);
    }
  }
  g_block_n = 256;
  g_cluster = false;
}

// The same with the raster groups split where the expert changes (Options::group_experts): experts
// of 2-4 tiles straddling the groups of 8, zero- and one-row experts; both the fused form and the
// unfused dgrad it is compared with take the split order.
TEST(GroupedGemm, DgradSwiGLUExpertSplitRaster) {
  MOK_REQUIRE_GPUS(1);
  g_group_experts = true;
  for (int bn : {256, 128}) {
    g_block_n = bn;
    dswiglu_case({260, 300, 129, 257, 0, 385, 200, 1, 260, 260}, 512, 256, 0, 811);
    dswiglu_case({260, 300, 129, 257, 0, 385, 200, 1, 260, 260}, 328, 160, 7, 812);
  }
  g_block_n = 256;
  g_group_experts = false;
}

// Bad buffers are named: gu misaligned, d_gu overlapping gu other than exactly (in place is fine),
// inter not a multiple of 32 (the gate/up order's group).
TEST(GroupedGemm, DgradSwiGLURejectsBadBuffers) {
  MOK_REQUIRE_GPUS(1);
  const Routed rt({100, 30});
  const int64_t inter = 64, hidden = 128;
  DevBuf dy(size_t(rt.rows * hidden) * 2), w(size_t(2 * hidden * inter) * 2), te(rt.tile_expert.size() * 4),
      gu(size_t(rt.rows * 2 * inter) * 2 * 2 + 64);
  upload(te, rt.tile_expert);
  gemm::DgradSwiGLUArgs a{.dy = dy.p, .w_down = w.p, .gu = gu.p, .hidden = hidden, .inter = inter, .experts = 2,
                          .tile_expert = te.as<int32_t>(), .num_m_tiles = rt.num_m_tiles()};
  const auto rejects = [&](const gemm::DgradSwiGLUArgs& args, const std::string& argument) {
    try {
      gemm::plan_dgrad_swiglu(args);
      ADD_FAILURE() << "accepted bad " << argument;
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  auto* base = static_cast<char*>(gu.p);
  a.d_gu = base + 2 * inter * 2;  // one row further: overlaps
  rejects(a, "dgrad_swiglu.d_gu");
  a.d_gu = base + rt.rows * 2 * inter * 2;  // right after gu: fine
  EXPECT_NO_THROW(gemm::plan_dgrad_swiglu(a));
  a.d_gu = gu.p;  // in place: fine
  EXPECT_NO_THROW(gemm::plan_dgrad_swiglu(a));
  a.gu = base + 4;
  a.d_gu = base + 4;
  rejects(a, "dgrad_swiglu.gu");
  a.gu = a.d_gu = gu.p;
  a.inter = 48;
  rejects(a, "dgrad_swiglu.inter");
}

// ---------------------------------------------------------------------------------------------
// Wgrad accumulating into fp32: dw[e] += sum_{rows of e} a[r]^T b[r] (the plain form: test_grouped_gemm.cu)
// ---------------------------------------------------------------------------------------------
// WgradArgs::accumulate: dw (and dw_up) fp32, added to. Into zeros the call leaves the fp32 sums,
// whose bf16 rounding is the bf16 form's output bit for bit (the same tiles and K order); into
// random values v it leaves v + those sums, one fp32 add per element, bit for bit; an expert
// without rows keeps v. gate_up: packed gate/up rows split into dw (gate) and dw_up (up).
void wgrad_accumulate_case(const std::vector<int32_t>& counts, int64_t m, int64_t n, int max_ctas, uint64_t seed,
                           bool gate_up) {
  SCOPED_TRACE(testing::Message() << "wgrad accumulate m=" << m << " n=" << n << " ctas=" << max_ctas
                                  << " gate_up=" << gate_up << " bn=" << g_block_n);
  WgradProblem pr(counts, m, n, seed);
  const int64_t E = pr.E, out = E * m * n;
  DevBuf dw(size_t(out) * 2), df(size_t(out) * 4);
  Device dev;
  dev.block_n = g_block_n;
  gemm::WgradArgs g = pr.g;
  // The bf16 form (gate_up: the two halves at dw and dw + out / 2).
  g.dw = dw.p;
  g.dw_up = gate_up ? static_cast<uint16_t*>(dw.p) + out / 2 : nullptr;
  gemm::run(gemm::plan_wgrad(g, dev.opts(max_ctas)), nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
  const auto ref = download<uint16_t>(dw, size_t(out));
  // Accumulated into zeros, then into random values.
  g.accumulate = true;
  g.dw = df.p;
  g.dw_up = gate_up ? static_cast<float*>(df.p) + out / 2 : nullptr;
  const auto plan = gemm::plan_wgrad(g, dev.opts(max_ctas));
  std::vector<float> v0(size_t(out), 0.0f);
  upload(df, v0);
  gemm::run(plan, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
  const auto sums = download<float>(df, size_t(out));
  const auto vb = random_bf16(size_t(out), seed + 7);
  std::vector<float> v(static_cast<size_t>(out));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float_of(vb[i]) * float(1 + i % 5);
  upload(df, v);
  gemm::run(plan, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
  const auto acc = download<float>(df, size_t(out));
  int64_t round_bad = 0, add_bad = 0;
  for (size_t i = 0; i < size_t(out); ++i) {
    // (0 + a sum of -0 is +0: signed zeros count as equal)
    round_bad += bits_of(sums[i]) != ref[i] && !(sums[i] == 0.0f && float_of(ref[i]) == 0.0f);
    const float want = v[i] + sums[i];
    add_bad += std::memcmp(&want, &acc[i], 4) != 0;
  }
  EXPECT_EQ(round_bad, 0) << "bf16(the accumulated fp32 sums) differs from the bf16 form's output";
  EXPECT_EQ(add_bad, 0) << "accumulating into v did not give v + the sums";
  std::printf("[wgrad accumulate bn=%d] E=%lld M=%lld N=%lld gate_up=%d: %lld / %lld differ\n", plan.block_n,
              (long long)E, (long long)m, (long long)n, int(gate_up), (long long)round_bad, (long long)add_bad);
}

TEST(GroupedGemm, WgradAccumulatesIntoFp32) {
  MOK_REQUIRE_GPUS(1);
  wgrad_accumulate_case({0, 1, 63, 128, 200, 385}, 200, 328, 7, 421, false);
  wgrad_accumulate_case({700, 64, 129}, 512, 768, 0, 422, false);
  wgrad_accumulate_case({0, 1, 63, 128, 200, 385}, 256, 328, 5, 423, true);  // gate/up split
  g_block_n = 128;
  wgrad_accumulate_case({300, 0, 5, 77}, 192, 200, 3, 424, false);
  wgrad_accumulate_case({300, 0, 5, 77}, 192, 200, 0, 425, true);
  g_block_n = 256;
}

}  // namespace
