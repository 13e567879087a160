// A naive fp64 model of the whole layer: every expert applied to every token, masked by the
// routing; no rounding anywhere. Independent of mok's layout code on purpose: it is what the CPU
// reference engine (the spec) is checked against, by the CPU tests and by mok_bench's CPU verdict.
// Not part of mok_core (nor of the installed library): tests/cpu and bench compile this file into
// their own binaries.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace mok::ref {

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

struct F64Grads {
  std::vector<std::vector<double>> d_x, d_w;  // per rank [T, H], [T, k]
  std::vector<double> d_wg, d_wu, d_wd;       // all experts
  std::vector<std::vector<double>> d_sg, d_su, d_sd;  // per rank
};

// Analytic fp64 gradients of f64_loss.
F64Grads f64_backward(const LayerShape& shape, const Workload& wl, const F64Params& p);

// Values as one fp64 vector, ranks concatenated (for rel_error).
std::vector<double> flat_f64(const std::vector<bf16>& v);
std::vector<double> flat_f64(const std::vector<std::vector<bf16>>& v);
std::vector<double> flat_f64(const std::vector<std::vector<float>>& v);
std::vector<double> flat_f64(const std::vector<std::vector<double>>& v);

// How far the engine may be from this model: bf16 rounding (2^-9 relative) at g, u, h, y and the
// output, accumulated over a few GEMMs, stays well under 1% of the norm; gradients pass through
// more rounding points (2%).
inline constexpr double kF64ForwardTol = 1e-2;
inline constexpr double kF64BackwardTol = 2e-2;

struct TensorError {
  const char* name;  // the Gradients member, e.g. "d_w_up"
  double rel_err;
};

struct F64Comparison {
  double forward_rel_err = 0;        // out, all ranks
  std::vector<TensorError> backward;  // every gradient tensor (shared-expert ones only when Is > 0)
  // The largest backward error (nullptr when no gradients were compared).
  const TensorError* worst_backward() const;
  bool within_tolerances() const;
};

// rel_error of the engine's forward output and, when `grads` is given, of each gradient tensor
// against this model on the same workload (f64_forward / f64_backward: seconds at mok_bench's
// medium preset, single-threaded).
F64Comparison compare_to_f64(const Workload& wl, const ForwardResult& fwd, const Gradients* grads);

}  // namespace mok::ref
