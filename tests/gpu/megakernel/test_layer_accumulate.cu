// GradRefs::accumulate on the GPU layer: the routed experts' weight gradients added to fp32
// tensors (gradient accumulation into a main_grad) on the bf16 unfused backward, resident and
// over windows of the ring; the refusals of the paths that do not have it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "layer_test_util.h"
#include "mok/bf16.hpp"
#include "mok/errors.hpp"
#include "mok/layer.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::grads_of;
using mok::test::kGradNames;
using mok::test::RankData;
using mok::test::RankGrads;
using mok::test::ranks_on_gpus;
using mok::test::upload;

struct AccCase {
  const char* name;
  mok::ForwardPath path;
  int64_t ring;  // Config::macrobatch_tokens (0: the default)
};
class LayerBackwardAccumulate : public ::testing::TestWithParam<AccCase> {};

// Into zeros, the fp32 gradients' bf16 rounding is the bf16 backward's weight gradients bit for bit
// (the same tiles and K order; only the final rounding is gone); a second forward + backward adds
// the same sums again, exactly twice them (x + x is exact in fp32); the other gradients (d_x,
// d_topk_w, the shared expert's) are the bf16 backward's.
TEST_P(LayerBackwardAccumulate, AddsTheSumsTheBf16BackwardRounds) {
  MOK_REQUIRE_GPUS(1);
  const AccCase& c = GetParam();
  const mok::LayerShape shape{{1536}, 1024, 256, 16, 4, 256};
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 123);
  mok::Config cfg;
  cfg.forward_path = c.path;
  if (c.ring > 0) {
    cfg.minibatch_tokens = 128;
    cfg.macrobatch_tokens = c.ring;
    ASSERT_LT(c.ring, shape.worst_case_rows()) << "the case must run over windows";
  }
  const auto want = grads_of(shape, cfg, wl, 1);  // bf16, overwritten
  auto group = ranks_on_gpus(1, shape, cfg);
  RankData d(shape, wl, 0);
  RankGrads gr(shape, 0);
  const int64_t el = shape.local_experts(), H = shape.hidden, I = shape.intermediate;
  const int64_t n[3] = {el * I * H, el * I * H, el * H * I};
  float* f32[3] = {};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(cudaSuccess, cudaMalloc(&f32[i], n[i] * 4));
    ASSERT_EQ(cudaSuccess, cudaMemset(f32[i], 0, n[i] * 4));
  }
  mok::DeviceGrads g = gr.g;
  g.accumulate = true;
  g.d_w_gate = mok::TensorRef::contiguous(f32[0], mok::DType::F32, {el, I, H});
  g.d_w_up = mok::TensorRef::contiguous(f32[1], mok::DType::F32, {el, I, H});
  g.d_w_down = mok::TensorRef::contiguous(f32[2], mok::DType::F32, {el, H, I});
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
  mok::Layer layer(group[0], shape, cfg, d.dw);
  std::vector<std::vector<float>> once;
  for (int rep = 0; rep < 2; ++rep) {
    d.forward_once(layer, group[0]);
    gr.poison();
    layer.backward(d.refs, dref, g, group[0].stream());
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(group[0].stream()));
    layer.check();
    const auto other = gr.fetch();  // d_x, d_topk_w and the shared expert's: bf16, overwritten
    for (size_t o : {0, 1, 5, 6, 7}) {
      int64_t differ = 0;
      for (size_t i = 0; i < want[o].size(); ++i) differ += std::memcmp(&want[o][i], &other[o][i], 4) != 0;
      EXPECT_EQ(differ, 0) << c.name << " backward " << rep + 1 << ": " << kGradNames[o];
    }
    for (int w = 0; w < 3; ++w) {
      const auto got = mok::test::download(f32[w], n[w]);
      int64_t bad = 0;
      if (rep == 0) {
        for (int64_t i = 0; i < n[w]; ++i)  // (signed zeros count as equal: 0 + -0 is +0)
          bad += mok::bf16::from_float(got[size_t(i)]) != mok::bf16::from_float(want[2 + w][size_t(i)]) &&
                 !(got[size_t(i)] == 0.0f && want[2 + w][size_t(i)] == 0.0f);
        once.push_back(got);
      } else {
        for (int64_t i = 0; i < n[w]; ++i) {
          const float twice = once[size_t(w)][size_t(i)] + once[size_t(w)][size_t(i)];
          bad += std::memcmp(&twice, &got[size_t(i)], 4) != 0;
        }
      }
      EXPECT_EQ(bad, 0) << c.name << " backward " << rep + 1 << ": " << kGradNames[2 + w] << ": " << bad << " of "
                        << n[w] << (rep == 0 ? " round to other bf16 values" : " are not twice the first sums");
    }
  }
  std::printf("[layer accumulate] %s: weight gradients accumulated in fp32 over 2 backwards\n", c.name);
  cudaFree(d_out);
  for (float* p : f32) cudaFree(p);
}

INSTANTIATE_TEST_SUITE_P(Paths, LayerBackwardAccumulate,
                         ::testing::Values(AccCase{"unfused_resident", mok::ForwardPath::Unfused, 0},
                                           AccCase{"megakernel_windows_ring256", mok::ForwardPath::Megakernel, 256}),
                         [](const auto& i) { return std::string(i.param.name); });

// Where accumulate is not built, the backward refuses it by name: the backward's GEMM program
// (config.backward_path fused) and FP8.
TEST(LayerBackwardAccumulateRefusals, EachNamesTheFlag) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{512}, 1024, 256, 16, 4, 0};
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 5);
  for (const int which : {0, 1}) {
    mok::Config cfg;
    cfg.forward_path = mok::ForwardPath::Unfused;
    if (which == 0) cfg.backward_path = mok::BackwardPath::Fused;
    if (which == 1) cfg.precision = mok::Precision::FP8;
    auto group = ranks_on_gpus(1, shape, cfg);
    RankData d(shape, wl, 0);
    RankGrads gr(shape, 0);
    const int64_t el = shape.local_experts(), H = shape.hidden, I = shape.intermediate;
    float* f = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&f, 3 * el * I * H * 4));
    mok::DeviceGrads g = gr.g;
    g.accumulate = true;
    g.d_w_gate = mok::TensorRef::contiguous(f, mok::DType::F32, {el, I, H});
    g.d_w_up = mok::TensorRef::contiguous(f + el * I * H, mok::DType::F32, {el, I, H});
    g.d_w_down = mok::TensorRef::contiguous(f + 2 * el * I * H, mok::DType::F32, {el, H, I});
    mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
    const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
    mok::Layer layer(group[0], shape, cfg, d.dw);
    d.forward_once(layer, group[0]);
    try {
      layer.backward(d.refs, dref, g, group[0].stream());
      ADD_FAILURE() << "accumulate accepted with " << (which == 0 ? "backward_path fused" : "fp8");
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), "grads.accumulate") << e.what();
    }
    cudaFree(d_out);
    cudaFree(f);
  }
}

}  // namespace
