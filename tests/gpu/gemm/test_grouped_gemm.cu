// Grouped GEMM forms (FC1 + SwiGLU, FC2, dgrad, wgrad) vs fp64 computations on random data, and the
// tile options across forms (consumer stagger, BLOCK_N 128, split-N, 2-CTA clusters, raster groups
// split at experts).
//
// Every case: random bf16 inputs (padding rows of the routed buffer hold NaN, so a leak of a
// padding row into a real one fails), outputs poisoned with NaN before the run, every element of
// every real row checked (finite, and relative error ||gpu - ref|| / ||ref|| <= 1e-2 against the
// fp64 product), experts with 0, 1, few and many rows, K and N not multiples of the block sizes,
// few CTAs (many tiles per CTA, the stage ring wraps) and all SMs, and bitwise equality of two runs.
//
// The forms that extend these (FC2's dgrad fused with the SwiGLU backward, wgrad accumulating
// into fp32) are in test_grouped_gemm_variants.cu.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "grouped_gemm_cases.h"
#include "mok/gemm.hpp"

namespace {

using namespace mok::test;           // DevBuf, Routed, routed_input, ErrStat, ... (gemm_test_util.h)
using namespace mok::test::grouped;  // Device, run_twice, g_block_n, ... (grouped_gemm_cases.h)
namespace gemm = mok::gemm;

// FC1/FC2 plans get the experts' rows, so tiles with <= 64 token rows run in split-N form.
bool g_split = false;

// Device copies of the experts' first rows and row counts (for split-N).
struct ExpertRows {
  DevBuf begin, rows;
  explicit ExpertRows(const Routed& rt) : begin(rt.begin.size() * 4 + 4), rows(rt.counts.size() * 4 + 4) {
    upload(begin, rt.begin);
    upload(rows, rt.counts);
  }
};

// ---------------------------------------------------------------------------------------------
// FC1 + SwiGLU
// ---------------------------------------------------------------------------------------------
// Outputs of one run (poisoned first), for cases that compare two settings bit for bit.
using Outputs = std::vector<std::vector<uint16_t>>;

void fc1_case(const std::vector<int32_t>& counts, int64_t hidden, int64_t inter, int max_ctas, uint64_t seed,
              int check_cols_stride = 1, int skew = 0, Outputs* outputs = nullptr) {
  SCOPED_TRACE(testing::Message() << "fc1 hidden=" << hidden << " inter=" << inter << " ctas=" << max_ctas
                                  << " skew=" << skew);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, n = 2 * inter;
  const auto x = routed_input(rt, hidden, seed);
  const auto wg = random_bf16(size_t(E * inter * hidden), seed + 1, 0.05);
  const auto wu = random_bf16(size_t(E * inter * hidden), seed + 2, 0.05);
  DevBuf dx(x.size() * 2), dwg(wg.size() * 2), dwu(wu.size() * 2), dte(rt.tile_expert.size() * 4 + 4);
  DevBuf dh(size_t(rows * inter) * 2), dgu(size_t(rows * n) * 2);
  upload(dx, x);
  upload(dwg, wg);
  upload(dwu, wu);
  upload(dte, rt.tile_expert);

  Device dev;
  dev.skew = skew;
  dev.block_n = g_block_n;
  gemm::Fc1Args a;
  a.x = dx.p;
  a.w_gate = dwg.p;  // read where they are: no packed copy
  a.w_up = dwu.p;
  a.h = dh.p;
  a.gu = dgu.p;
  a.hidden = hidden;
  a.inter = inter;
  a.experts = E;
  a.tile_expert = dte.as<int32_t>();
  a.num_m_tiles = rt.num_m_tiles();
  const ExpertRows er(rt);
  if (g_split) {
    a.expert_row_begin = er.begin.as<int32_t>();
    a.expert_rows = er.rows.as<int32_t>();
  }
  const auto plan = gemm::plan_fc1(a, dev.opts(max_ctas));
  std::vector<std::vector<uint16_t>> r1, r2;
  std::vector<DevBuf*> outs{&dh, &dgu};
  run_twice(plan, dev, outs, r1, r2);
  const auto& h = r1[0];
  const auto& gu = r1[1];

  const auto xd = to_double(x), wgd = to_double(wg), wud = to_double(wu);
  ErrStat sg, su, sh;
  int64_t swiglu_mismatch = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    const double* xr = &xd[size_t(r * hidden)];
    for (int64_t i = 0; i < inter; i += check_cols_stride) {
      const double* g_w = &wgd[size_t((e * inter + i) * hidden)];
      const double* u_w = &wud[size_t((e * inter + i) * hidden)];
      double g = 0, u = 0;
      for (int64_t k = 0; k < hidden; ++k) {
        g += xr[k] * g_w[k];
        u += xr[k] * u_w[k];
      }
      const float gg = float_of(gu[size_t(r * n + gemm::packed_gate_row(i))]);
      const float ug = float_of(gu[size_t(r * n + gemm::packed_up_row(i))]);
      const float hg = float_of(h[size_t(r * inter + i)]);
      sg.add(gg, g);
      su.add(ug, u);
      sh.add(hg, g / (1.0 + std::exp(-g)) * u);
      // The epilogue's rounding points, replayed on the GPU's own g and u.
      const float want = mok::round_bf16(gg / (1.0f + std::exp(-gg)) * ug);
      if (std::fabs(hg - want) > 0.0079f * std::fabs(want) + 1e-30f) ++swiglu_mismatch;
    }
  }
  EXPECT_EQ(sg.nonfinite + su.nonfinite + sh.nonfinite, 0) << "unwritten or NaN outputs in real rows";
  EXPECT_LE(sg.rel(), kTol) << "gate";
  EXPECT_LE(su.rel(), kTol) << "up";
  EXPECT_LE(sh.rel(), kTol) << "h";
  EXPECT_EQ(swiglu_mismatch, 0) << "h differs from rnd(silu(g)*u) of the stored g, u by more than 1 ulp";
  EXPECT_EQ(plan.block_n, g_block_n);
  std::printf("[fc1 bn=%d] rows=%lld H=%lld I=%lld ctas=%d  rel err gate %.2e up %.2e h %.2e (checked %lld)\n",
              plan.block_n, (long long)rows, (long long)hidden, (long long)inter, plan.grid, sg.rel(), su.rel(), sh.rel(),
              (long long)sh.count);
  if (outputs) *outputs = r1;
  // Without gu (the inference forward): the same h bits, and gu is never written.
  gemm::Fc1Args no_gu = a;
  no_gu.gu = nullptr;
  const auto plan_no_gu = gemm::plan_fc1(no_gu, dev.opts(max_ctas));
  std::vector<std::vector<uint16_t>> q1, q2;
  run_twice(plan_no_gu, dev, outs, q1, q2);
  EXPECT_TRUE(q1[0] == h) << "h differs when gu is not stored";
  int64_t written = 0;
  for (uint16_t v : q1[1]) written += v != 0xFFFF;
  EXPECT_EQ(written, 0) << "gu written by a plan without gu";
}

TEST(GroupedGemm, Fc1SwiGLUSmallExpertsPartialBlocks) {
  MOK_REQUIRE_GPUS(1);
  // K = 328 (5 full blocks + 8), N = 2*224 = 448 (one full tile + 192 columns).
  fc1_case({0, 1, 63, 128, 200, 385}, 328, 224, 5, 101);
  fc1_case({0, 1, 63, 128, 200, 385}, 328, 224, 0, 102);
}

TEST(GroupedGemm, Fc1SwiGLUManyTiles) {
  MOK_REQUIRE_GPUS(1);
  fc1_case({512, 300, 0, 1000, 17}, 1024, 512, 13, 103, 7);
  fc1_case({512, 300, 0, 1000, 17}, 1024, 512, 0, 104, 7);
}

// ---------------------------------------------------------------------------------------------
// FC2 (plain): y = a . W[e]^T, W [E, n, k]; and dgrad: dx = dy . W[e], W [E, k, n]
// ---------------------------------------------------------------------------------------------
void plain_case(bool dgrad, const std::vector<int32_t>& counts, int64_t k, int64_t n, int max_ctas, uint64_t seed,
                int check_cols_stride = 1, int skew = 0, Outputs* outputs = nullptr) {
  SCOPED_TRACE(testing::Message() << (dgrad ? "dgrad" : "fc2") << " k=" << k << " n=" << n << " ctas=" << max_ctas
                                  << " skew=" << skew);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows;
  const auto a = routed_input(rt, k, seed);
  const auto w = random_bf16(size_t(E * n * k), seed + 1, 0.05);  // [E, n, k] (fc2) or [E, k, n] (dgrad)
  DevBuf da(a.size() * 2), dw(w.size() * 2), dte(rt.tile_expert.size() * 4 + 4), dy(size_t(rows * n) * 2);
  upload(da, a);
  upload(dw, w);
  upload(dte, rt.tile_expert);
  const ExpertRows er(rt);
  Device dev;
  dev.skew = skew;
  dev.block_n = g_block_n;
  gemm::Plan plan;
  if (dgrad) {
    gemm::DgradArgs g;
    g.dy = da.p;
    g.w = dw.p;
    g.dx = dy.p;
    g.k = k;
    g.n = n;
    g.experts = E;
    g.tile_expert = dte.as<int32_t>();
    g.num_m_tiles = rt.num_m_tiles();
    plan = gemm::plan_dgrad(g, dev.opts(max_ctas));
  } else {
    gemm::Fc2Args f;
    f.a = da.p;
    f.w = dw.p;
    f.y = dy.p;
    f.k = k;
    f.n = n;
    f.experts = E;
    f.tile_expert = dte.as<int32_t>();
    f.num_m_tiles = rt.num_m_tiles();
    if (g_split) {
      f.expert_row_begin = er.begin.as<int32_t>();
      f.expert_rows = er.rows.as<int32_t>();
    }
    plan = gemm::plan_fc2(f, dev.opts(max_ctas));
  }
  std::vector<std::vector<uint16_t>> r1, r2;
  std::vector<DevBuf*> outs{&dy};
  run_twice(plan, dev, outs, r1, r2);
  const auto& y = r1[0];
  const auto ad = to_double(a), wd = to_double(w);
  ErrStat st;
  for (int64_t r = 0; r < rows; ++r) {
    const int e = rt.expert_of(r);
    if (e < 0) continue;
    const double* ar = &ad[size_t(r * k)];
    const double* we = &wd[size_t(e * n * k)];
    for (int64_t c = 0; c < n; c += check_cols_stride) {
      double ref = 0;
      if (dgrad)
        for (int64_t kk = 0; kk < k; ++kk) ref += ar[kk] * we[kk * n + c];
      else
        for (int64_t kk = 0; kk < k; ++kk) ref += ar[kk] * we[c * k + kk];
      st.add(float_of(y[size_t(r * n + c)]), ref);
    }
  }
  EXPECT_EQ(st.nonfinite, 0) << "unwritten or NaN outputs in real rows";
  EXPECT_LE(st.rel(), kTol);
  EXPECT_EQ(plan.block_n, g_block_n);
  std::printf("[%s bn=%d] rows=%lld K=%lld N=%lld ctas=%d  rel err %.2e (checked %lld)\n", dgrad ? "dgrad" : "fc2",
              plan.block_n, (long long)rows, (long long)k, (long long)n, plan.grid, st.rel(), (long long)st.count);
  if (outputs) *outputs = r1;
}

TEST(GroupedGemm, Fc2SmallExpertsPartialBlocks) {
  MOK_REQUIRE_GPUS(1);
  plain_case(false, {0, 1, 63, 128, 200, 385}, 200, 328, 5, 201);
  plain_case(false, {0, 1, 63, 128, 200, 385}, 200, 328, 0, 202);
}

TEST(GroupedGemm, Fc2ManyTiles) {
  MOK_REQUIRE_GPUS(1);
  plain_case(false, {512, 300, 0, 1000, 17}, 512, 1024, 11, 203, 5);
}

TEST(GroupedGemm, DgradMNMajorWeights) {
  MOK_REQUIRE_GPUS(1);
  plain_case(true, {0, 1, 63, 128, 200, 385}, 328, 200, 5, 301);
  plain_case(true, {512, 300, 0, 1000, 17}, 1024, 512, 0, 302, 5);
}

// ---------------------------------------------------------------------------------------------
// Wgrad: dw[e] = sum_{rows of e} a[r]^T b[r], a [rows, m], b [rows, n]
// ---------------------------------------------------------------------------------------------
void wgrad_case(const std::vector<int32_t>& counts, int64_t m, int64_t n, int max_ctas, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "wgrad m=" << m << " n=" << n << " ctas=" << max_ctas);
  WgradProblem pr(counts, m, n, seed);
  const Routed& rt = pr.rt;
  const int64_t E = pr.E;
  const auto& a = pr.a;
  const auto& b = pr.b;
  DevBuf dw(size_t(E * m * n) * 2);
  Device dev;
  dev.block_n = g_block_n;
  gemm::WgradArgs g = pr.g;
  g.dw = dw.p;
  const auto plan = gemm::plan_wgrad(g, dev.opts(max_ctas));
  std::vector<std::vector<uint16_t>> r1, r2;
  std::vector<DevBuf*> outs{&dw};
  run_twice(plan, dev, outs, r1, r2);
  const auto& w = r1[0];
  const auto ad = to_double(a), bd = to_double(b);
  ErrStat st;
  int64_t nonzero_empty = 0;
  std::vector<double> acc(static_cast<size_t>(n), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < m; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t r = rt.begin[size_t(e)]; r < rt.begin[size_t(e)] + counts[size_t(e)]; ++r) {
        const double av = ad[size_t(r * m + i)];
        const double* br = &bd[size_t(r * n)];
        for (int64_t j = 0; j < n; ++j) acc[size_t(j)] += av * br[j];
      }
      for (int64_t j = 0; j < n; ++j) {
        const float got = float_of(w[size_t((e * m + i) * n + j)]);
        if (counts[size_t(e)] == 0) {
          nonzero_empty += got != 0.0f;
          continue;
        }
        st.add(got, acc[size_t(j)]);
      }
    }
  EXPECT_EQ(st.nonfinite, 0) << "unwritten or NaN outputs (padding rows leaked?)";
  EXPECT_EQ(nonzero_empty, 0) << "experts without rows must get a zero gradient";
  EXPECT_LE(st.rel(), kTol);
  EXPECT_EQ(plan.block_n, g_block_n);
  std::printf("[wgrad bn=%d] E=%lld M=%lld N=%lld ctas=%d  rel err %.2e (checked %lld)\n", plan.block_n,
              (long long)E, (long long)m,
              (long long)n, plan.grid, st.rel(), (long long)st.count);
}

TEST(GroupedGemm, WgradKGroupedMaskedPadding) {
  MOK_REQUIRE_GPUS(1);
  wgrad_case({0, 1, 63, 128, 200, 385}, 200, 328, 7, 401);
  wgrad_case({0, 1, 63, 128, 200, 385}, 200, 328, 0, 402);
  wgrad_case({700, 64, 129}, 512, 768, 0, 403);
  // 9 M tiles: two raster groups of the default group_m 8, the last one short (the decode's
  // RasterPlan on the GPU).
  wgrad_case({300, 0, 129}, 1152, 200, 0, 404);
  // Last K blocks of every step count (1-16, 17-32, 33-48, 49-63 valid rows: 1 to 4 of the block's
  // K steps issued, mma_tile), next to full ones, NaN padding behind each.
  wgrad_case({16, 17, 32, 33, 48, 49, 63, 64, 80, 97, 113, 127, 250, 0, 1}, 200, 328, 5, 405);
}

TEST(GroupedGemm, NoTilesLaunchesNothing) {
  MOK_REQUIRE_GPUS(1);
  gemm::Fc2Args f;
  DevBuf d(64);
  f.a = d.p;
  f.w = d.p;
  f.y = d.p;
  f.k = 64;
  f.n = 64;
  f.experts = 4;
  f.num_m_tiles = 0;
  const auto plan = gemm::plan_fc2(f);
  EXPECT_EQ(plan.grid, 0);
  gemm::run(plan, nullptr);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
}

TEST(GroupedGemm, StaggeredConsumerWarpgroups) {
  MOK_REQUIRE_GPUS(1);
  // K = 1024: 16 blocks per tile, staggered; K = 320: 5 blocks, too short, not staggered.
  for (int skew = 1; skew <= 4; ++skew) {
    fc1_case({512, 300, 0, 1000, 17}, 1024, 512, 13, 105 + skew, 7, skew);
    plain_case(false, {512, 300, 0, 1000, 17}, 1024, 512, 7, 205 + skew, 5, skew);
  }
  plain_case(true, {0, 1, 63, 128, 200, 385}, 320, 200, 5, 305, 1, 3);
}

TEST(GroupedGemm, BlockN128AllForms) {
  MOK_REQUIRE_GPUS(1);
  g_block_n = 128;
  fc1_case({0, 1, 63, 128, 200, 385}, 328, 224, 5, 501);
  fc1_case({512, 300, 0, 1000, 17}, 1024, 512, 0, 502, 7, 3);
  plain_case(false, {0, 1, 63, 128, 200, 385}, 200, 328, 5, 503);
  plain_case(false, {512, 300, 0, 1000, 17}, 1024, 512, 11, 504, 5, 2);
  plain_case(true, {0, 1, 63, 128, 200, 385}, 328, 200, 0, 505);
  wgrad_case({0, 1, 63, 128, 200, 385}, 200, 328, 7, 506);
  g_block_n = 256;
}

TEST(GroupedGemm, BlockNHeuristic) {
  // 192 tiles of 256 on 132 SMs: 2 waves; 384 tiles of 128: 3 waves of half the work -> 128.
  EXPECT_EQ(gemm::choose_block_n(16, 3072, 132), 128);
  // Many waves either way -> 256.
  EXPECT_EQ(gemm::choose_block_n(128, 4096, 132), 256);
}

// Tiles whose tokens fit in their first 64 rows in split-N form: tails of 1, 63 and 64 rows split,
// 65 does not; an odd tile count (with clusters the last pair has a dummy); FC1 and FC2 at
// BLOCK_N 256 and 128 (FC1 at 128 stores each warpgroup's 32 h columns directly; I = 200 leaves
// warpgroup 0's half of the last tile partly past I, I = 232 warpgroup 1's); with clusters and
// with the consumer stagger. Every run must match the reference, and give the same bits in the
// token rows as without split-N (same fp32 sums in the same K order).
void same_token_rows(const Routed& rt, const Outputs& a, const Outputs& b, const std::vector<int64_t>& cols) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t o = 0; o < a.size(); ++o) {
    int64_t differ = 0;
    for (int64_t r = 0; r < rt.rows; ++r) {
      if (rt.expert_of(r) < 0) continue;
      for (int64_t c = 0; c < cols[o]; ++c) differ += a[o][size_t(r * cols[o] + c)] != b[o][size_t(r * cols[o] + c)];
    }
    EXPECT_EQ(differ, 0) << "output " << o << ": split-N changed bits in token rows";
  }
}

TEST(GroupedGemm, SplitNForNearlyEmptyTiles) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> counts{0, 1, 63, 64, 65, 129, 192, 200, 385, 1};  // 15 tiles
  const Routed rt(counts);
  for (bool cluster : {false, true}) {
    g_cluster = cluster;
    for (int skew : {0, 2}) {
      for (int bn : {256, 128}) {
        g_block_n = bn;
        Outputs off, on;
        g_split = false;
        fc1_case(counts, 1024, 512, 0, 702, 7, skew, &off);
        g_split = true;
        fc1_case(counts, 1024, 512, 0, 702, 7, skew, &on);
        same_token_rows(rt, off, on, {512, 1024});
        fc1_case(counts, 328, 160, 5, 701);  // I = 160: warpgroup 0's half of the last tile partly past I
        fc1_case(counts, 328, 224, 5, 705);  // I = 224: warpgroup 1's half partly (BLOCK_N 256) or wholly past I
        g_split = false;
        plain_case(false, counts, 1024, 512, 0, 704, 5, skew, &off);
        g_split = true;
        plain_case(false, counts, 1024, 512, 0, 704, 5, skew, &on);
        same_token_rows(rt, off, on, {512});
        plain_case(false, counts, 200, 328, 6, 703);
      }
    }
  }
  g_block_n = 256;
  g_cluster = false;
  g_split = false;
}

// Raster groups split where the expert changes (Options::group_experts): experts of 2-4 tiles
// that straddle the groups of 8, a zero-row expert and a one-row one, few CTAs and all SMs. The
// same tiles in another order: the token rows' bits equal the plain raster's, and the reference
// holds.
TEST(GroupedGemm, ExpertSplitRasterGroups) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> counts{260, 300, 129, 257, 0, 385, 200, 1, 260, 260};  // 24 tiles
  const Routed rt(counts);
  for (int bn : {256, 128}) {
    g_block_n = bn;
    Outputs off, on;
    g_group_experts = false;
    fc1_case(counts, 1024, 512, 0, 801, 7, 0, &off);
    g_group_experts = true;
    fc1_case(counts, 1024, 512, 0, 801, 7, 0, &on);
    same_token_rows(rt, off, on, {512, 1024});
    fc1_case(counts, 328, 224, 5, 802);
    g_group_experts = false;
    plain_case(false, counts, 1024, 512, 0, 803, 5, 0, &off);
    g_group_experts = true;
    plain_case(false, counts, 1024, 512, 0, 803, 5, 0, &on);
    same_token_rows(rt, off, on, {512});
    g_group_experts = false;
    plain_case(true, counts, 512, 1024, 9, 804, 5, 0, &off);
    g_group_experts = true;
    plain_case(true, counts, 512, 1024, 9, 804, 5, 0, &on);
    same_token_rows(rt, off, on, {1024});
  }
  g_block_n = 256;
  g_group_experts = false;
}

TEST(GroupedGemm, ClustersMulticastB) {
  MOK_REQUIRE_GPUS(1);
  g_cluster = true;
  for (int bn : {256, 128}) {
    g_block_n = bn;
    // Expert tile runs of odd length (pairs straddle experts: B not shared), an odd tile count
    // (the last pair has a dummy), zero-row experts, few CTAs (ring wraps) and all SMs.
    fc1_case({0, 1, 63, 128, 200, 385}, 328, 224, 4, 601);
    fc1_case({512, 300, 0, 1000, 17}, 1024, 512, 0, 602, 7);
    plain_case(false, {0, 1, 63, 128, 200, 385}, 200, 328, 6, 603);
    plain_case(false, {512, 300, 0, 1000, 17}, 1024, 512, 10, 604, 5);
    plain_case(true, {0, 1, 63, 128, 200, 385}, 328, 200, 4, 605);
    plain_case(true, {512, 300, 0, 1000, 17}, 1024, 512, 0, 606, 5);
    wgrad_case({0, 1, 63, 128, 200, 385}, 200, 328, 6, 607);
    wgrad_case({700, 64, 129}, 512, 768, 0, 608);
  }
  g_block_n = 256;
  g_cluster = false;
}

}  // namespace
