// A naive fp64 model of the whole layer for tests: every expert applied to every token, masked
// by the routing; no rounding anywhere. Independent of mok's layout code on purpose.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/workload.hpp"

namespace mok::test {

struct F64Params {
  std::vector<std::vector<double>> x;  // per rank [T, H]
  std::vector<std::vector<double>> w;  // per rank [T, k]
  std::vector<double> wg, wu, wd;      // [E, I, H], [E, I, H], [E, H, I]
  std::vector<double> sg, su, sd;      // [Is, H], [Is, H], [H, Is]
};

F64Params to_f64(const Workload& wl);

// out per rank [T, H].
std::vector<std::vector<double>> f64_forward(const LayerShape& shape, const Workload& wl,
                                             const F64Params& p);

// sum over ranks, tokens, h of out * d_out (the scalar whose gradient backward computes).
double f64_loss(const LayerShape& shape, const Workload& wl, const F64Params& p);

// ||a - b|| / ||b|| over all values.
double rel_error(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace mok::test

namespace mok::test {

struct F64Grads {
  std::vector<std::vector<double>> d_x, d_w;  // per rank [T, H], [T, k]
  std::vector<double> d_wg, d_wu, d_wd;       // all experts
  std::vector<std::vector<double>> d_sg, d_su, d_sd;  // per rank
};

// Analytic fp64 gradients of f64_loss.
F64Grads f64_backward(const LayerShape& shape, const Workload& wl, const F64Params& p);

}  // namespace mok::test
