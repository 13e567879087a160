// The grouped-GEMM forms composed into the FFN forward-and-backward of one rank's experts, against
// the specification's rounding points (include/mok/reference.hpp, "backward"), replayed in fp64:
//   FC1 forward            gu = (g, u) packed, h = rnd(silu(g) * u)          plan_fc1 (split-N on)
//   FC2 dgrad + SwiGLU'    d_gu = (rnd(s (1 + g (1 - s)) u dh), rnd(g s dh)),
//                          dh = rnd(dy . W_down[e])                          plan_dgrad_swiglu
//   FC1 dgrad              d_x = rnd(d_gu . [W_gate; W_up][e]) (packed K)     plan_dgrad (w_up)
//   wgrads                 dW_down[e] = rnd(sum dy^T h), dW1p[e] = rnd(sum d_gu^T x)  plan_wgrad
//   (and FC2 forward       y = rnd(h . W_down[e]^T)                           plan_fc2, split-N on)
// What no single-form test pins: the packed gate/up order flows through every form (d_gu comes out
// in the order FC1's dgrad and wgrad take, dW1p in the packed order, i.e. dW_gate and dW_up
// after unpacking), and padding rows never leak into a reduction: x and dy hold NaN there, and
// split-N FC1 tiles leave rows 64..127 of gu and h unwritten (NaN poison here).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/gemm.hpp"

namespace {

using namespace mok::test;  // DevBuf, Routed, routed_input, to_double, ErrStat, ... (gemm_test_util.h)
namespace gemm = mok::gemm;

double rnd(double v) { return mok::round_bf16(float(v)); }

struct Reference {
  std::vector<double> y;                // [rows, H] (real rows only)
  std::vector<double> d_x;              // [rows, H] (real rows only)
  std::vector<double> dw_down;          // [E, H, I]
  std::vector<double> dw_gate, dw_up;   // [E, I, H]
};

// fp64 sums, rounded to bf16 where the specification rounds.
Reference reference(const Routed& rt, const std::vector<double>& x, const std::vector<double>& dy,
                    const std::vector<double>& wg, const std::vector<double>& wu, const std::vector<double>& wd,
                    int64_t H, int64_t I) {
  const int64_t E = int64_t(rt.counts.size());
  Reference ref;
  ref.d_x.assign(size_t(rt.rows * H), 0.0);
  ref.y.assign(size_t(rt.rows * H), 0.0);
  ref.dw_down.assign(size_t(E * H * I), 0.0);
  ref.dw_gate.assign(size_t(E * I * H), 0.0);
  ref.dw_up.assign(size_t(E * I * H), 0.0);
  const auto n_i = static_cast<size_t>(I);
  std::vector<double> h(n_i), dg(n_i), du(n_i);
  for (int64_t e = 0; e < E; ++e) {
    const double* g_w = &wg[size_t(e * I * H)];
    const double* u_w = &wu[size_t(e * I * H)];
    const double* d_w = &wd[size_t(e * H * I)];
    for (int64_t r = rt.begin[size_t(e)]; r < rt.begin[size_t(e)] + rt.counts[size_t(e)]; ++r) {
      const double* xr = &x[size_t(r * H)];
      const double* dyr = &dy[size_t(r * H)];
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0, dh = 0;
        for (int64_t k = 0; k < H; ++k) {
          g += xr[k] * g_w[i * H + k];
          u += xr[k] * u_w[i * H + k];
          dh += dyr[k] * d_w[k * I + i];
        }
        g = rnd(g);
        u = rnd(u);
        dh = rnd(dh);
        const double s = 1.0 / (1.0 + std::exp(-g));
        h[size_t(i)] = rnd(g * s * u);
        du[size_t(i)] = rnd(g * s * dh);
        dg[size_t(i)] = rnd(s * (1.0 + g * (1.0 - s)) * u * dh);
      }
      for (int64_t k = 0; k < H; ++k) {
        double acc = 0, y = 0;
        for (int64_t i = 0; i < I; ++i) {
          acc += dg[size_t(i)] * g_w[i * H + k] + du[size_t(i)] * u_w[i * H + k];
          y += h[size_t(i)] * d_w[k * I + i];
        }
        ref.d_x[size_t(r * H + k)] = rnd(acc);
        ref.y[size_t(r * H + k)] = rnd(y);
        for (int64_t i = 0; i < I; ++i) ref.dw_down[size_t((e * H + k) * I + i)] += dyr[k] * h[size_t(i)];
      }
      for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < H; ++k) {
          ref.dw_gate[size_t((e * I + i) * H + k)] += dg[size_t(i)] * xr[k];
          ref.dw_up[size_t((e * I + i) * H + k)] += du[size_t(i)] * xr[k];
        }
    }
  }
  for (auto* v : {&ref.dw_down, &ref.dw_gate, &ref.dw_up})
    for (double& w : *v) w = rnd(w);
  return ref;
}

// Options of every plan of the chain. pdl: launched with programmatic dependent launch, so each
// kernel is scheduled before its predecessor ends and must wait for it (griddepcontrol.wait)
// before it reads the predecessor's output. The outputs are returned for a bitwise comparison
// between variants.
struct Variant {
  bool pdl = false;
};

void ffn_backward_case(const std::vector<int32_t>& counts, int64_t H, int64_t I, int max_ctas, uint64_t seed,
                       const Variant& v = {}, std::vector<std::vector<uint16_t>>* outputs = nullptr) {
  SCOPED_TRACE(testing::Message() << "ffn backward H=" << H << " I=" << I << " ctas=" << max_ctas << " pdl=" << v.pdl);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows;
  const auto x = routed_input(rt, H, seed);
  const auto dy = routed_input(rt, H, seed + 1);  // d_y, already weighted (the reverse combine's output)
  const auto wg = random_bf16(size_t(E * I * H), seed + 2, 0.05);
  const auto wu = random_bf16(size_t(E * I * H), seed + 3, 0.05);
  const auto wd = random_bf16(size_t(E * H * I), seed + 4, 0.05);
  const size_t w1_elems = size_t(E * 2 * I * H);  // dW1 in packed rows (the wgrad without dw_up)

  DevBuf d_x_in(x.size() * 2), d_dy(dy.size() * 2), d_wg(wg.size() * 2), d_wu(wu.size() * 2), d_wd(wd.size() * 2),
      d_te(rt.tile_expert.size() * 4 + 4), d_beg(rt.begin.size() * 4 + 4), d_cnt(rt.counts.size() * 4 + 4),
      d_h(size_t(rows * I) * 2), d_gu(size_t(rows * 2 * I) * 2), d_dgu(size_t(rows * 2 * I) * 2),
      d_dx(size_t(rows * H) * 2), d_dwd(size_t(E * H * I) * 2), d_dw1p(w1_elems * 2), d_y(size_t(rows * H) * 2),
      err(sizeof(unsigned));
  upload(d_x_in, x);
  upload(d_dy, dy);
  upload(d_wg, wg);
  upload(d_wu, wu);
  upload(d_wd, wd);
  upload(d_te, rt.tile_expert);
  upload(d_beg, rt.begin);
  upload(d_cnt, rt.counts);
  for (DevBuf* b : {&d_h, &d_gu, &d_dgu, &d_dx, &d_dwd, &d_dw1p, &d_y})
    ASSERT_EQ(cudaSuccess, cudaMemset(b->p, 0xFF, b->bytes));  // NaN poison
  ASSERT_EQ(cudaSuccess, cudaMemset(err.p, 0, sizeof(unsigned)));
  const gemm::Options o{.max_ctas = max_ctas, .error = err.as<unsigned>(), .wait_limit_s = 5.0, .pdl = v.pdl};

  const int32_t* te = d_te.as<int32_t>();
  const int32_t* beg = d_beg.as<int32_t>();
  const int32_t* cnt = d_cnt.as<int32_t>();
  const int64_t mt = rt.num_m_tiles();
  // FC1 with the experts' rows: split-N for tails of <= 64 rows, as in the megakernel.
  const gemm::Fc1Args f{.x = d_x_in.p, .w_gate = d_wg.p, .w_up = d_wu.p, .h = d_h.p, .gu = d_gu.p, .hidden = H, .inter = I,
                        .experts = E, .tile_expert = te, .num_m_tiles = mt, .expert_row_begin = beg,
                        .expert_rows = cnt};
  const gemm::Fc2Args f2{.a = d_h.p, .w = d_wd.p, .y = d_y.p, .k = I, .n = H, .experts = E, .tile_expert = te,
                         .num_m_tiles = mt, .expert_row_begin = beg, .expert_rows = cnt};
  const gemm::DgradSwiGLUArgs s{.dy = d_dy.p, .w_down = d_wd.p, .gu = d_gu.p, .d_gu = d_dgu.p, .hidden = H,
                                .inter = I, .experts = E, .tile_expert = te, .num_m_tiles = mt};
  const gemm::DgradArgs d{.dy = d_dgu.p, .w = d_wg.p, .dx = d_dx.p, .k = 2 * I, .n = H, .experts = E,
                          .tile_expert = te, .num_m_tiles = mt, .w_up = d_wu.p};
  const gemm::WgradArgs w2{.a = d_dy.p, .b = d_h.p, .dw = d_dwd.p, .m = H, .n = I, .experts = E,
                           .rows_total = rows, .expert_row_begin = beg, .expert_rows = cnt};
  const gemm::WgradArgs w1{.a = d_dgu.p, .b = d_x_in.p, .dw = d_dw1p.p, .m = 2 * I, .n = H, .experts = E,
                           .rows_total = rows, .expert_row_begin = beg, .expert_rows = cnt};
  for (const gemm::Plan& p : {gemm::plan_fc1(f, o), gemm::plan_fc2(f2, o), gemm::plan_dgrad_swiglu(s, o),
                              gemm::plan_dgrad(d, o), gemm::plan_wgrad(w2, o), gemm::plan_wgrad(w1, o)})
    gemm::run(p, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  const auto dx = download<uint16_t>(d_dx, size_t(rows * H));
  const auto dwd = download<uint16_t>(d_dwd, size_t(E * H * I));
  const auto dw1p = download<uint16_t>(d_dw1p, w1_elems);
  const auto y = download<uint16_t>(d_y, size_t(rows * H));
  // FC1's wgrad written unpacked (dw_up): dW_gate and dW_up in plain order, the same bits as
  // dW1p's packed rows.
  {
    DevBuf d_gate(size_t(E * I * H) * 2), d_up(size_t(E * I * H) * 2);
    ASSERT_EQ(cudaSuccess, cudaMemset(d_gate.p, 0xFF, d_gate.bytes));
    ASSERT_EQ(cudaSuccess, cudaMemset(d_up.p, 0xFF, d_up.bytes));
    gemm::WgradArgs split = w1;
    split.dw = d_gate.p;
    split.dw_up = d_up.p;
    gemm::run(gemm::plan_wgrad(split, o), nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
    const auto gate = download<uint16_t>(d_gate, size_t(E * I * H));
    const auto up = download<uint16_t>(d_up, size_t(E * I * H));
    int64_t differ = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < H; ++k) {
          const size_t at = size_t((e * I + i) * H + k);
          differ += gate[at] != dw1p[size_t((e * 2 * I + gemm::packed_gate_row(i)) * H + k)];
          differ += up[at] != dw1p[size_t((e * 2 * I + gemm::packed_up_row(i)) * H + k)];
        }
    EXPECT_EQ(differ, 0) << "dW_gate / dW_up written unpacked differ from dW1p's rows";
  }
  if (outputs) *outputs = {dx, dwd, dw1p, y};

  const Reference ref = reference(rt, to_double(x), to_double(dy), to_double(wg), to_double(wu), to_double(wd), H, I);
  ErrStat sx, sd, sg, su, sy;
  for (int64_t r = 0; r < rows; ++r)
    if (rt.expert_of(r) >= 0)
      for (int64_t k = 0; k < H; ++k) {
        sx.add(float_of(dx[size_t(r * H + k)]), ref.d_x[size_t(r * H + k)]);
        sy.add(float_of(y[size_t(r * H + k)]), ref.y[size_t(r * H + k)]);
      }
  int64_t nonzero_empty = 0;
  for (int64_t e = 0; e < E; ++e) {
    const bool empty = counts[size_t(e)] == 0;
    for (int64_t i = 0; i < H * I; ++i) {
      const float got = float_of(dwd[size_t(e * H * I + i)]);
      if (empty) nonzero_empty += got != 0.0f;
      else sd.add(got, ref.dw_down[size_t(e * H * I + i)]);
    }
    for (int64_t i = 0; i < I; ++i)
      for (int64_t k = 0; k < H; ++k) {
        const float g = float_of(dw1p[size_t((e * 2 * I + gemm::packed_gate_row(i)) * H + k)]);
        const float u = float_of(dw1p[size_t((e * 2 * I + gemm::packed_up_row(i)) * H + k)]);
        if (empty) {
          nonzero_empty += (g != 0.0f) + (u != 0.0f);
          continue;
        }
        sg.add(g, ref.dw_gate[size_t((e * I + i) * H + k)]);
        su.add(u, ref.dw_up[size_t((e * I + i) * H + k)]);
      }
  }
  EXPECT_EQ(sx.nonfinite + sd.nonfinite + sg.nonfinite + su.nonfinite + sy.nonfinite, 0) << "NaN reached a real output";
  EXPECT_LE(sy.rel(), 1e-2) << "y (FC2)";
  EXPECT_EQ(nonzero_empty, 0) << "experts without rows must get zero weight gradients";
  EXPECT_LE(sx.rel(), 1e-2) << "d_x";
  EXPECT_LE(sd.rel(), 1e-2) << "dW_down";
  EXPECT_LE(sg.rel(), 1e-2) << "dW_gate";
  EXPECT_LE(su.rel(), 1e-2) << "dW_up";
  std::printf("[ffn backward%s] rows=%lld H=%lld I=%lld ctas=%d  rel err y %.2e, d_x %.2e, dW_down %.2e, "
              "dW_gate %.2e, dW_up %.2e\n",
              v.pdl ? " pdl" : "", (long long)rows, (long long)H, (long long)I, max_ctas, sy.rel(), sx.rel(), sd.rel(),
              sg.rel(), su.rel());
}

TEST(FfnBackward, FormsComposeIntoTheSpecifiedBackward) {
  MOK_REQUIRE_GPUS(1);
  // Experts with 0, 1, 63 (split-N FC1 tile), 128, 200 and 385 rows; K and N off the block sizes.
  ffn_backward_case({0, 1, 63, 128, 200, 385}, 328, 224, 0, 901);
  ffn_backward_case({0, 1, 63, 128, 200, 385}, 328, 224, 5, 902);  // few CTAs: the stage ring wraps
  ffn_backward_case({40, 0, 300, 129}, 512, 256, 0, 903);
}

// The chain under a variant of the options gives the same bits as under the defaults: every real
// row of d_x and y (padding rows are undefined) and the weight gradients.
void expect_same_bits(const std::vector<int32_t>& counts, int64_t H, int64_t I, int max_ctas, uint64_t seed,
                      const Variant& v, const char* what) {
  const Routed rt(counts);
  std::vector<std::vector<uint16_t>> base, var;
  ffn_backward_case(counts, H, I, max_ctas, seed, Variant{}, &base);
  ffn_backward_case(counts, H, I, max_ctas, seed, v, &var);
  ASSERT_EQ(base.size(), 4u);
  ASSERT_EQ(var.size(), 4u);
  int64_t dx_differ = 0, y_differ = 0;
  for (int64_t r = 0; r < rt.rows; ++r)
    if (rt.expert_of(r) >= 0)
      for (int64_t k = 0; k < H; ++k) {
        const size_t i = size_t(r * H + k);
        dx_differ += base[0][i] != var[0][i];
        y_differ += base[3][i] != var[3][i];
      }
  EXPECT_EQ(dx_differ, 0) << "d_x differs with " << what;
  EXPECT_EQ(y_differ, 0) << "y differs with " << what;
  EXPECT_TRUE(base[1] == var[1]) << "dW_down differs with " << what;
  EXPECT_TRUE(base[2] == var[2]) << "dW1p differs with " << what;
}

TEST(FfnBackward, ProgrammaticDependentLaunchGivesTheSameBits) {
  MOK_REQUIRE_GPUS(1);
  expect_same_bits({0, 1, 63, 128, 200, 385}, 328, 224, 0, 904, Variant{.pdl = true}, "programmatic dependent launch");
}

}  // namespace
