// mok — the specification for one token (include/mok/reference.hpp's rounding points, fp32 sums
// in increasing index order, no fused multiply-add): what the reference engine computes for that
// token, without running the whole layer. The GPU benchmark checks sampled tokens of model-sized
// runs with it (where the engine would take minutes); the CPU tests check it against the engine
// bit for bit. Shared experts are not included (the benchmark's shapes have none).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace mok::ref {

// One token through one expert: g, u, h (I values each) and y (H values), bf16-rounded.
struct TokenExpert {
  std::vector<float> g, u, h, y;
};
// `w`: the expert's weights as fp32 (of bf16 values), gate [I, H], up [I, H], down [H, I], one
// after the other. x: the token's H values.
TokenExpert token_through_expert(int64_t H, int64_t I, const float* w, const float* x);

// The expert weights (layout above) of global expert e.
using ExpertWeights = std::function<const float*(int32_t e)>;

// out[t] for one token (H values): sum over its k slots of fma(w_j, y_j), rounded once.
std::vector<float> token_forward(int64_t H, int64_t I, int64_t k, const float* x, const int32_t* topk_idx,
                                 const float* topk_w, const ExpertWeights& expert);
// The backward for one token: d_x (H values) followed by d_topk_w (k values).
std::vector<float> token_backward(int64_t H, int64_t I, int64_t k, const float* x, const float* d_out,
                                  const int32_t* topk_idx, const float* topk_w, const ExpertWeights& expert);

}  // namespace mok::ref
