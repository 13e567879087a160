// The spec for one token (src/reference/token_spec.h) is the reference engine's arithmetic for
// that token: out, d_x and d_topk_w bit for bit, on uniform and empty-slot routing, EP 1 and 2;
// and the FP8 forward (Config::precision FP8, recipe 1) likewise.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mok/reference.hpp"
#include "mok/workload.hpp"
#include "reference/token_spec.h"

namespace {

// Every expert's weights as floats in the spec's layout: gate [I, H], up [I, H], down [H, I].
std::vector<std::vector<float>> experts_as_float(const mok::LayerShape& shape, const mok::Workload& wl) {
  const int64_t H = shape.hidden, I = shape.intermediate;
  std::vector<std::vector<float>> experts(static_cast<size_t>(shape.experts));
  for (int64_t e = 0; e < shape.experts; ++e) {
    auto& w = experts[static_cast<size_t>(e)];
    for (const auto* src : {&wl.weights.w_gate, &wl.weights.w_up, &wl.weights.w_down})
      for (int64_t i = 0; i < I * H; ++i) w.push_back(float((*src)[static_cast<size_t>(e * I * H + i)]));
  }
  return experts;
}

TEST(TokenSpec, EqualsTheEngineBitForBit) {
  for (const int world : {1, 2}) {
    for (const mok::Routing routing : {mok::Routing::Uniform, mok::Routing::EmptySlots}) {
      const mok::LayerShape shape = mok::LayerShape::uniform(world, 40, 128, 64, 8, 3);
      const auto wl = mok::make_workload(shape, routing, 11);
      const mok::ref::Engine engine(shape, mok::Config{});
      const auto fwd = engine.forward(wl.inputs, wl.weights);
      const auto bwd = engine.backward(wl.inputs, wl.weights, wl.d_out);
      const int64_t H = shape.hidden, I = shape.intermediate, k = shape.top_k;
      const std::vector<std::vector<float>> experts = experts_as_float(shape, wl);
      const mok::ref::ExpertWeights expert = [&](int32_t e) { return experts[static_cast<size_t>(e)].data(); };
      for (int r = 0; r < world; ++r) {
        const auto& in = wl.inputs[static_cast<size_t>(r)];
        for (int64_t t = 0; t < shape.tokens_of(r); ++t) {
          std::vector<float> x(static_cast<size_t>(H)), d(static_cast<size_t>(H));
          for (int64_t c = 0; c < H; ++c) {
            x[static_cast<size_t>(c)] = float(in.x[static_cast<size_t>(t * H + c)]);
            d[static_cast<size_t>(c)] = float(wl.d_out[static_cast<size_t>(r)][static_cast<size_t>(t * H + c)]);
          }
          const auto out = mok::ref::token_forward(H, I, k, x.data(), &in.topk_idx[t * k], &in.topk_w[t * k], expert);
          const auto back = mok::ref::token_backward(H, I, k, x.data(), d.data(), &in.topk_idx[t * k],
                                                     &in.topk_w[t * k], expert);
          for (int64_t c = 0; c < H; ++c) {
            ASSERT_EQ(out[static_cast<size_t>(c)], float(fwd.out[static_cast<size_t>(r)][static_cast<size_t>(t * H + c)]))
                << "out, rank " << r << " token " << t << " column " << c;
            ASSERT_EQ(back[static_cast<size_t>(c)], float(bwd.d_x[static_cast<size_t>(r)][static_cast<size_t>(t * H + c)]))
                << "d_x, rank " << r << " token " << t << " column " << c;
          }
          for (int64_t j = 0; j < k; ++j) {
            const float got = back[static_cast<size_t>(H + j)];
            const float want = bwd.d_topk_w[static_cast<size_t>(r)][static_cast<size_t>(t * k + j)];
            ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << "d_topk_w, rank " << r << " token " << t;
          }
        }
      }
    }
  }
}

// Both FP8 recipes: FP8 (1 x 128 / 128 x 128 blocks) and MXFP8 (1 x 32 E8M0 blocks along K).
TEST(TokenSpec, Fp8ForwardEqualsTheEngineBitForBit) {
  for (const mok::Precision precision : {mok::Precision::FP8, mok::Precision::MXFP8})
  for (const mok::Routing routing : {mok::Routing::Uniform, mok::Routing::EmptySlots}) {
    SCOPED_TRACE(mok::to_string(precision));
    // Two 128-wide blocks along H and I, and an I block cut short (h per 1 x 128: 320 = 2.5 blocks).
    const mok::LayerShape shape = mok::LayerShape::uniform(2, 24, 256, 320, 8, 3);
    const auto wl = mok::make_workload(shape, routing, 13);
    mok::Config cfg;
    cfg.precision = precision;
    const auto fwd = mok::ref::Engine(shape, cfg).forward(wl.inputs, wl.weights);
    const int64_t H = shape.hidden, I = shape.intermediate, k = shape.top_k;
    std::vector<std::vector<float>> experts = experts_as_float(shape, wl);
    for (auto& w : experts) mok::ref::fp8_round_weights(H, I, w.data(), precision);
    const mok::ref::ExpertWeights expert = [&](int32_t e) { return experts[static_cast<size_t>(e)].data(); };
    for (int r = 0; r < shape.world_size(); ++r) {
      const auto& in = wl.inputs[static_cast<size_t>(r)];
      for (int64_t t = 0; t < shape.tokens_of(r); ++t) {
        std::vector<float> x(static_cast<size_t>(H));
        for (int64_t c = 0; c < H; ++c) x[static_cast<size_t>(c)] = float(in.x[static_cast<size_t>(t * H + c)]);
        const auto out =
            mok::ref::token_forward(H, I, k, x.data(), &in.topk_idx[t * k], &in.topk_w[t * k], expert, precision);
        for (int64_t c = 0; c < H; ++c)
          ASSERT_EQ(out[static_cast<size_t>(c)], float(fwd.out[static_cast<size_t>(r)][static_cast<size_t>(t * H + c)]))
              << "fp8 out, rank " << r << " token " << t << " column " << c;
      }
    }
  }
}

}  // namespace
