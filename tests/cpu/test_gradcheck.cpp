// Gradients checked by central finite differences of the fp64 model's loss on tiny shapes:
//   (1) the fp64 analytic backward matches finite differences tightly (the model is right);
//   (2) the CPU reference's backward (bf16 rounding points) matches them within 3% of each
//       gradient tensor's largest entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "mok/reference.hpp"
#include "mok/workload.hpp"
#include "reference/fp64_model.h"
#include "test_names.h"

namespace {

struct Probe {
  const char* name;
  std::function<double&(mok::ref::F64Params&, int64_t)> param;  // coordinate i of the tensor
  int64_t size;
  std::function<double(const mok::ref::F64Grads&, int64_t)> analytic;
  std::function<double(const mok::ref::Gradients&, int64_t)> reference;
};

double fd(const mok::Workload& wl, mok::ref::F64Params p, const Probe& pr, int64_t i) {
  const double eps = 1e-5;
  double& v = pr.param(p, i);
  const double v0 = v;
  v = v0 + eps;
  const double lp = mok::ref::f64_loss(wl.shape, wl, p);
  v = v0 - eps;
  const double lm = mok::ref::f64_loss(wl.shape, wl, p);
  v = v0;
  return (lp - lm) / (2 * eps);
}

}  // namespace

class GradCheck : public ::testing::TestWithParam<mok::Routing> {};

TEST_P(GradCheck, FiniteDifferences) {
  auto shape = mok::LayerShape::uniform(2, 6, 64, 64, 4, 2, 64);
  shape.tokens[1] = 5;
  const auto wl = mok::make_workload(shape, GetParam(), 31);
  const auto p = mok::ref::to_f64(wl);
  const auto an = mok::ref::f64_backward(shape, wl, p);
  const auto rf = mok::ref::Engine(shape, mok::Config{}).backward(wl.inputs, wl.weights, wl.d_out);
  const int64_t H = 64, T0 = 6, k = 2, EIH = 4 * 64 * 64;

  using P = mok::ref::F64Params;
  using A = mok::ref::F64Grads;
  using R = mok::ref::Gradients;
  auto sum_ranks = [](const std::vector<std::vector<double>>& v, int64_t i) { return v[0][i] + v[1][i]; };
  auto sum_ranks_bf = [](const std::vector<std::vector<mok::bf16>>& v, int64_t i) {
    return double(float(v[0][i])) + double(float(v[1][i]));
  };
  const std::vector<Probe> probes = {
      {"x (rank 0)", [](P& q, int64_t i) -> double& { return q.x[0][i]; }, T0 * H,
       [](const A& a, int64_t i) { return a.d_x[0][i]; },
       [](const R& r, int64_t i) { return double(float(r.d_x[0][i])); }},
      {"topk_w (rank 1)", [](P& q, int64_t i) -> double& { return q.w[1][i]; }, 5 * k,
       [](const A& a, int64_t i) { return a.d_w[1][i]; },
       [](const R& r, int64_t i) { return double(r.d_topk_w[1][i]); }},
      {"w_gate", [](P& q, int64_t i) -> double& { return q.wg[i]; }, EIH,
       [](const A& a, int64_t i) { return a.d_wg[i]; },
       [](const R& r, int64_t i) { return double(float(r.d_w_gate[i])); }},
      {"w_up", [](P& q, int64_t i) -> double& { return q.wu[i]; }, EIH,
       [](const A& a, int64_t i) { return a.d_wu[i]; },
       [](const R& r, int64_t i) { return double(float(r.d_w_up[i])); }},
      {"w_down", [](P& q, int64_t i) -> double& { return q.wd[i]; }, EIH,
       [](const A& a, int64_t i) { return a.d_wd[i]; },
       [](const R& r, int64_t i) { return double(float(r.d_w_down[i])); }},
      {"ws_gate", [](P& q, int64_t i) -> double& { return q.sg[i]; }, 64 * 64,
       [&](const A& a, int64_t i) { return sum_ranks(a.d_sg, i); },
       [&](const R& r, int64_t i) { return sum_ranks_bf(r.d_ws_gate, i); }},
      {"ws_down", [](P& q, int64_t i) -> double& { return q.sd[i]; }, 64 * 64,
       [&](const A& a, int64_t i) { return sum_ranks(a.d_sd, i); },
       [&](const R& r, int64_t i) { return sum_ranks_bf(r.d_ws_down, i); }},
  };

  mok::Rng rng(77);
  for (const auto& pr : probes) {
    SCOPED_TRACE(pr.name);
    double scale = 0;
    for (int64_t i = 0; i < pr.size; ++i) scale = std::max(scale, std::abs(pr.analytic(an, i)));
    ASSERT_GT(scale, 0.0);
    int nonzero = 0;
    for (int s = 0; s < 24; ++s) {
      const int64_t i = rng.below(pr.size);
      const double f = fd(wl, p, pr, i);
      nonzero += std::abs(f) > 1e-3 * scale;
      EXPECT_NEAR(pr.analytic(an, i), f, 1e-6 * scale + 1e-8) << "coordinate " << i;
      EXPECT_NEAR(pr.reference(rf, i), f, 3e-2 * scale) << "coordinate " << i;
    }
    EXPECT_GT(nonzero, 0) << "all probed gradients vanished: the check would prove nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, GradCheck,
                         ::testing::Values(mok::Routing::Uniform, mok::Routing::EmptySlots),
                         [](const auto& p) { return mok::test::param_name(mok::to_string(p.param)); });
