// The GPU layer (unfused path) against the CPU reference, on 1 and 2 GPUs, with the routing
// cases of the spec; bitwise identical over repeated runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::download;
using mok::test::upload;

struct Case {
  const char* name;
  int world;
  std::vector<int64_t> tokens;
  int64_t H, I, E, k, Is;
  mok::Routing routing;
};

class LayerForward : public ::testing::TestWithParam<Case> {};

TEST_P(LayerForward, MatchesReferenceAndIsBitwiseReproducible) {
  const Case& c = GetParam();
  MOK_REQUIRE_GPUS(c.world);
  mok::LayerShape shape;
  shape.tokens = c.tokens;
  shape.hidden = c.H;
  shape.intermediate = c.I;
  shape.experts = c.E;
  shape.top_k = c.k;
  shape.shared_intermediate = c.Is;
  mok::Config cfg;
  cfg.fwd_comm_sms = 8;
  const auto wl = mok::make_workload(shape, c.routing, 31337);
  const auto ref = mok::ref::Engine(shape, cfg).forward(wl.inputs, wl.weights);

  std::vector<int> devices(c.world);
  for (int r = 0; r < c.world; ++r) devices[r] = r;
  mok::comm::CommOptions opt;
  opt.shape = shape;
  opt.config = cfg;
  auto group = mok::comm::LocalGroup::create(devices, opt);
  std::mutex m;
  std::vector<double> rel(c.world);
  std::vector<int64_t> diffs(c.world);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    const int64_t T = shape.tokens_of(static_cast<int>(r)), H = c.H, I = c.I, k = c.k;
    const int64_t e_loc = shape.local_experts(), e0 = static_cast<int64_t>(r) * e_loc;
    const auto& W = wl.weights;
    mok::DeviceWeights dw;
    dw.w_gate = upload(&W.w_gate[e0 * I * H], e_loc * I * H);
    dw.w_up = upload(&W.w_up[e0 * I * H], e_loc * I * H);
    dw.w_down = upload(&W.w_down[e0 * H * I], e_loc * H * I);
    if (c.Is > 0) {
      dw.ws_gate = upload(W.ws_gate.data(), W.ws_gate.size());
      dw.ws_up = upload(W.ws_up.data(), W.ws_up.size());
      dw.ws_down = upload(W.ws_down.data(), W.ws_down.size());
    }
    const auto& in = wl.inputs[r];
    auto* x = upload(in.x.data(), in.x.size());
    auto* idx = upload(in.topk_idx.data(), in.topk_idx.size());
    auto* w = upload(in.topk_w.data(), in.topk_w.size());
    mok::bf16* out = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&out, std::max<int64_t>(1, T * H) * 2));
    mok::Layer layer(comm, shape, cfg, dw);
    mok::RoutingRefs refs{mok::TensorRef::contiguous(x, mok::DType::BF16, {T, H}),
                          mok::TensorRef::contiguous(idx, mok::DType::I32, {T, k}),
                          mok::TensorRef::contiguous(w, mok::DType::F32, {T, k})};
    std::vector<mok::bf16> first;
    for (int rep = 0; rep < 3; ++rep) {
      ASSERT_EQ(cudaSuccess, cudaMemset(out, 0xff, std::max<int64_t>(1, T * H) * 2));  // poison
      layer.forward(refs, out, comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      layer.check();
      std::vector<mok::bf16> got(T * H);
      if (T) ASSERT_EQ(cudaSuccess, cudaMemcpy(got.data(), out, T * H * 2, cudaMemcpyDeviceToHost));
      if (rep == 0) {
        first = got;
        double num = 0, den = 0;
        int64_t d = 0;
        for (int64_t i = 0; i < T * H; ++i) {
          const double a = float(got[i]), b = float(ref.out[r][i]);
          num += (a - b) * (a - b);
          den += b * b;
          d += got[i].bits != ref.out[r][i].bits;
          if (std::isnan(a)) num = INFINITY;
        }
        std::lock_guard<std::mutex> lock(m);
        rel[r] = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        diffs[r] = d;
      } else {
        int64_t changed = 0;
        for (int64_t i = 0; i < T * H; ++i) changed += got[i].bits != first[i].bits;
        EXPECT_EQ(changed, 0) << "rank " << r << " repetition " << rep << " differs from the first";
      }
    }
    for (const void* p : {dw.w_gate, dw.w_up, dw.w_down, dw.ws_gate, dw.ws_up, dw.ws_down})
      if (p) cudaFree(const_cast<void*>(p));
    cudaFree(x);
    cudaFree(idx);
    cudaFree(w);
    cudaFree(out);
  });
  for (int r = 0; r < c.world; ++r) {
    std::printf("[layer] %s rank %d: rel err %.2e vs CPU reference, %lld of %lld values differ in bits\n",
                c.name, r, rel[r], (long long)diffs[r], (long long)(shape.tokens_of(r) * c.H));
    EXPECT_LT(rel[r], 1e-2) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, LayerForward,
    ::testing::Values(
        Case{"ep1_uniform_shared", 1, {700}, 1024, 512, 16, 4, 512, mok::Routing::Uniform},
        Case{"ep2_zipf", 2, {600, 333}, 1024, 512, 16, 4, 0, mok::Routing::Zipf},
        Case{"ep2_empty_slots_t0_shared", 2, {512, 0}, 2048, 768, 32, 8, 256, mok::Routing::EmptySlots},
        Case{"ep2_one_rank", 2, {400, 400}, 1024, 256, 8, 2, 0, mok::Routing::OneRank},
        Case{"ep2_one_expert_shared", 2, {300, 500}, 1024, 512, 16, 4, 512, mok::Routing::OneExpert}),
    [](const auto& p) { return std::string(p.param.name); });

}  // namespace
