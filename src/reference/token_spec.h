// mok — the specification for one token (include/mok/reference.hpp's rounding points, fp32 sums
// in increasing index order, no fused multiply-add): what the reference engine computes for that
// token, without running the whole layer. The GPU benchmark checks sampled tokens of model-sized
// runs with it (where the engine would take minutes); the CPU tests check it against the engine
// bit for bit. Shared experts are not included (the benchmark's shapes have none).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "mok/config.hpp"

namespace mok::ref {

// One token through one expert: g, u, h (I values each) and y (H values), bf16-rounded.
struct TokenExpert {
  std::vector<float> g, u, h, y;
};
// `w`: the expert's weights as fp32 (of bf16 values), gate [I, H], up [I, H], down [H, I], one
// after the other. x: the token's H values.
// precision FP8 / MXFP8: h is quantized before FC2 (1 x 128 blocks / MX 1 x 32 blocks).
TokenExpert token_through_expert(int64_t H, int64_t I, const float* w, const float* x,
                                 Precision precision = Precision::BF16);

// The expert weights (layout above) of global expert e.
using ExpertWeights = std::function<const float*(int32_t e)>;

// out[t] for one token (H values): sum over its k slots of fma(w_j, y_j), rounded once.
// precision FP8 (recipe 1): x is quantized per 1 x 128 first and each expert's h per 1 x 128
// before FC2 (the values then are what the codes decode to); MXFP8 (recipe 2): the same with MX
// blocks (E8M0 scale per 32 along K). `expert` must give the weights as their codes decode
// (fp8_round_weights with the same precision).
std::vector<float> token_forward(int64_t H, int64_t I, int64_t k, const float* x, const int32_t* topk_idx,
                                 const float* topk_w, const ExpertWeights& expert,
                                 Precision precision = Precision::BF16);
// One expert's weights (the layout above) replaced by what their codes decode to, as the engine's
// FP8 / MXFP8 forward holds them: each matrix per 128 x 128 (FP8), or per 1 x 32 along its K (MXFP8).
void fp8_round_weights(int64_t H, int64_t I, float* w, Precision precision = Precision::FP8);
// The backward for one token: d_x (H values) followed by d_topk_w (k values).
std::vector<float> token_backward(int64_t H, int64_t I, int64_t k, const float* x, const float* d_out,
                                  const int32_t* topk_idx, const float* topk_w, const ExpertWeights& expert);

}  // namespace mok::ref
