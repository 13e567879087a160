// Helpers shared by the GPU layer tests (test_layer.cu, test_reliability.cu): one rank's device
// inputs, weights and gradient buffers for a workload, bitwise and relative comparisons, and the
// rank groups the tests run on.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace mok::test {

// An environment knob set for a scope (the layer reads its MOK_* knobs when built), unset again
// however the scope ends.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) { setenv(n, value, 1); }
  ~ScopedEnv() { unsetenv(name); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

// One rank's device inputs and weights for a workload (freed on destruction).
struct RankData {
  mok::DeviceWeights dw;
  std::vector<const void*> weight_ptrs;  // owned: freed on destruction
  mok::bf16* x = nullptr;
  int32_t* idx = nullptr;
  float* w = nullptr;
  mok::bf16* out = nullptr;
  int64_t T = 0, H = 0;
  mok::RoutingRefs refs;
  RankData(const mok::LayerShape& shape, const mok::Workload& wl, int r) {
    T = shape.tokens_of(r);
    H = shape.hidden;
    const int64_t I = shape.intermediate, k = shape.top_k;
    const int64_t e_loc = shape.local_experts(), e0 = static_cast<int64_t>(r) * e_loc;
    const auto& W = wl.weights;
    weight_ptrs = {upload(&W.w_gate[e0 * I * H], e_loc * I * H), upload(&W.w_up[e0 * I * H], e_loc * I * H),
                   upload(&W.w_down[e0 * H * I], e_loc * H * I), nullptr, nullptr, nullptr};
    if (shape.shared_intermediate > 0) {
      weight_ptrs[3] = upload(W.ws_gate.data(), W.ws_gate.size());
      weight_ptrs[4] = upload(W.ws_up.data(), W.ws_up.size());
      weight_ptrs[5] = upload(W.ws_down.data(), W.ws_down.size());
    }
    dw = mok::DeviceWeights::bf16(shape, weight_ptrs[0], weight_ptrs[1], weight_ptrs[2], weight_ptrs[3],
                                  weight_ptrs[4], weight_ptrs[5]);
    const auto& in = wl.inputs[r];
    x = upload(in.x.data(), in.x.size());
    idx = upload(in.topk_idx.data(), in.topk_idx.size());
    w = upload(in.topk_w.data(), in.topk_w.size());
    EXPECT_EQ(cudaSuccess, cudaMalloc(&out, std::max<int64_t>(1, T * H) * 2));
    refs = mok::RoutingRefs{mok::TensorRef::contiguous(x, mok::DType::BF16, {T, H}),
                            mok::TensorRef::contiguous(idx, mok::DType::I32, {T, k}),
                            mok::TensorRef::contiguous(w, mok::DType::F32, {T, k})};
  }
  ~RankData() {
    for (const void* p : weight_ptrs)
      if (p) cudaFree(const_cast<void*>(p));
    cudaFree(x);
    cudaFree(idx);
    cudaFree(w);
    cudaFree(out);
  }
  RankData(const RankData&) = delete;
  RankData& operator=(const RankData&) = delete;
  // The memset runs on the legacy stream, which the communicator's non-blocking stream does not
  // wait for: synchronize, so the poison lands before forward() writes.
  void poison() const {
    EXPECT_EQ(cudaSuccess, cudaMemset(out, 0xff, std::max<int64_t>(1, T * H) * 2));
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  }
  std::vector<mok::bf16> result() const { return download(out, T * H); }
  mok::TensorRef out_ref() const { return mok::TensorRef::contiguous(out, mok::DType::BF16, {T, H}); }
  // Poisons out, runs one forward of `layer` on the communicator's stream (inputs `in`, default
  // this rank's refs), waits, raises device-side errors and returns out.
  std::vector<mok::bf16> forward_once(mok::Layer& layer, mok::comm::Communicator& comm,
                                      const mok::RoutingRefs* in = nullptr, bool save_for_backward = true) const {
    poison();
    layer.forward(in ? *in : refs, out_ref(), comm.stream(), save_for_backward);
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
    layer.check();
    return result();
  }
};

inline int64_t bit_diffs(const std::vector<mok::bf16>& a, const std::vector<mok::bf16>& b) {
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i].bits != b[i].bits;
  return d;
}

// `world` ranks on GPUs 0 .. world-1, with the layer's shape and config in the start-up handshake.
inline mok::comm::LocalGroup ranks_on_gpus(int world, const mok::LayerShape& shape, const mok::Config& cfg) {
  std::vector<int> devices(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) devices[static_cast<size_t>(r)] = r;
  mok::comm::CommOptions opt;
  opt.shape = shape;
  opt.config = cfg;
  return mok::comm::LocalGroup::create(devices, opt);
}
inline mok::comm::LocalGroup two_ranks(const mok::LayerShape& shape, const mok::Config& cfg) {
  return ranks_on_gpus(2, shape, cfg);
}

// One rank's gradient buffers (device), poisoned before each backward.
struct RankGrads {
  mok::DeviceGrads g;
  void* p[8] = {};  // owned raw buffers behind g, in GradRefs' order
  int64_t n_x = 0, n_w = 0, n_gate = 0, n_down = 0, n_sgate = 0, n_sdown = 0;
  RankGrads(const mok::LayerShape& s, int r) {
    const int64_t T = s.tokens_of(r), H = s.hidden, I = s.intermediate, E = s.local_experts(), Is = s.shared_intermediate;
    n_x = T * H;
    n_w = T * s.top_k;
    n_gate = E * I * H;
    n_down = E * H * I;
    n_sgate = Is * H;
    n_sdown = H * Is;
    p[0] = alloc(n_x * 2);
    p[1] = alloc(n_w * 4);
    p[2] = alloc(n_gate * 2);
    p[3] = alloc(n_gate * 2);
    p[4] = alloc(n_down * 2);
    if (Is > 0) {
      p[5] = alloc(n_sgate * 2);
      p[6] = alloc(n_sgate * 2);
      p[7] = alloc(n_sdown * 2);
    }
    g = mok::DeviceGrads::of(s, r, p[0], static_cast<float*>(p[1]), p[2], p[3], p[4], p[5], p[6], p[7]);
  }
  ~RankGrads() {
    for (void* q : p)
      if (q) cudaFree(q);
  }
  RankGrads(const RankGrads&) = delete;
  RankGrads& operator=(const RankGrads&) = delete;
  static void* alloc(int64_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaSuccess, cudaMalloc(&p, std::max<int64_t>(16, bytes)));
    EXPECT_EQ(cudaSuccess, cudaMemset(p, 0xff, std::max<int64_t>(16, bytes)));  // NaN poison
    return p;
  }
  void poison() const {
    const int64_t n[8] = {n_x * 2, n_w * 4, n_gate * 2, n_gate * 2, n_down * 2, n_sgate * 2, n_sgate * 2, n_sdown * 2};
    for (int i = 0; i < 8; ++i)
      if (p[i]) EXPECT_EQ(cudaSuccess, cudaMemset(p[i], 0xff, std::max<int64_t>(16, n[i])));
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  }
  // Every output as float, in a fixed order: d_x, d_topk_w, dW_gate, dW_up, dW_down, dWs_gate, dWs_up, dWs_down.
  std::vector<std::vector<float>> fetch() const {
    const auto bf = [](const void* p, int64_t n) {
      std::vector<float> v;
      if (p == nullptr) return v;
      for (const mok::bf16 b : download(static_cast<const mok::bf16*>(p), n)) v.push_back(float(b));
      return v;
    };
    return {bf(p[0], n_x), download(static_cast<const float*>(p[1]), n_w), bf(p[2], n_gate), bf(p[3], n_gate),
            bf(p[4], n_down), bf(p[5], n_sgate), bf(p[6], n_sgate), bf(p[7], n_sdown)};
  }
};

// Relative L2 error (infinite when a value is not finite).
inline double rel_err(const std::vector<float>& got, const float* want, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = got[i], b = want[i];
    if (!std::isfinite(a)) return INFINITY;
    num += (a - b) * (a - b);
    den += b * b;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
template <typename V>
std::vector<float> as_float(const V& v, int64_t begin, int64_t n) {
  std::vector<float> f(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) f[i] = float(v[begin + i]);
  return f;
}

// The gradients of `reps` forward + backward runs of one layer on one GPU (every run after the
// first checked bitwise against the first), as RankGrads::fetch returns them.
inline std::vector<std::vector<float>> grads_of(const mok::LayerShape& shape, const mok::Config& cfg, const mok::Workload& wl,
                                                 int reps) {
  auto group = ranks_on_gpus(1, shape, cfg);
  RankData d(shape, wl, 0);
  RankGrads gr(shape, 0);
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
  mok::Layer layer(group[0], shape, cfg, d.dw);
  std::vector<std::vector<float>> first;
  for (int rep = 0; rep < reps; ++rep) {
    d.forward_once(layer, group[0]);
    gr.poison();
    layer.backward(d.refs, dref, gr.g, group[0].stream());
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(group[0].stream()));
    layer.check();
    auto got = gr.fetch();
    if (rep == 0) first = got;
    for (size_t o = 0; rep > 0 && o < got.size(); ++o)
      EXPECT_TRUE(got[o] == first[o]) << "gradient " << o << " differs on backward " << rep + 1;
  }
  cudaFree(d_out);
  return first;
}

// The names of RankGrads::fetch's gradients, in its order.
inline const char* const kGradNames[] = {"d_x", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dWs_gate", "dWs_up", "dWs_down"};

// Every value of every gradient the same bits (grads_of's results of two configurations).
inline void expect_same_bits(const std::vector<std::vector<float>>& want, const std::vector<std::vector<float>>& got,
                             const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t o = 0; o < want.size(); ++o) {
    ASSERT_EQ(want[o].size(), got[o].size());
    int64_t differ = 0;
    for (size_t i = 0; i < want[o].size(); ++i) differ += std::memcmp(&want[o][i], &got[o][i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0) << what << ": " << kGradNames[o] << ": " << differ << " of " << want[o].size() << " differ";
  }
}

}  // namespace mok::test
