// mok_bench's GPU mode: the GPU layer on every visible GPU (one EP rank each, one process), at
// the model shapes, after a sampled check against the spec's arithmetic. Timing: per iteration
// the slowest rank's CUDA-event time of one forward(); the median over iterations is reported.
#include "gpu_layer_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>

#include "common/cuda_check.h"
#include "common/device_fill.h"
#include "mok/comm.hpp"
#include "mok/errors.hpp"
#include "mok/layer.hpp"
#include "util/bench_util.h"

namespace mok::bench {

namespace {

struct Model {
  const char* name;
  int64_t H, I, E, k;
};
constexpr Model kModels[] = {{"dsv3", 7168, 2048, 256, 8},
                             {"qwen3-30b-a3b", 2048, 768, 128, 8},
                             {"qwen3-235b", 4096, 1536, 128, 8}};

struct RankWeights {
  void* gate = nullptr;
  void* up = nullptr;
  void* down = nullptr;
};

// The spec's arithmetic (include/mok/reference.hpp) for one token, fp32 sums in order.
std::vector<float> expected_token(const Model& m, const std::vector<RankWeights>& w, int64_t e_loc,
                                  const std::vector<float>& x, const int32_t* idx, const float* wt,
                                  std::map<int64_t, std::vector<float>>& cache) {
  const int64_t H = m.H, I = m.I;
  auto expert = [&](int64_t e) -> const std::vector<float>& {
    auto it = cache.find(e);
    if (it != cache.end()) return it->second;
    std::vector<bf16> raw(static_cast<size_t>(3 * I * H));
    const RankWeights& rw = w[static_cast<size_t>(e / e_loc)];
    const size_t off = static_cast<size_t>((e % e_loc) * I * H);
    MOK_CUDA_CHECK(cudaMemcpy(raw.data(), static_cast<bf16*>(rw.gate) + off, I * H * 2, cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(raw.data() + I * H, static_cast<bf16*>(rw.up) + off, I * H * 2, cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(raw.data() + 2 * I * H, static_cast<bf16*>(rw.down) + off, I * H * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) f[i] = float(raw[i]);
    return cache.emplace(e, std::move(f)).first->second;
  };
  std::vector<float> acc(static_cast<size_t>(H), 0.0f), h(static_cast<size_t>(I));
  for (int64_t j = 0; j < m.k; ++j) {
    if (idx[j] < 0) continue;
    const auto& W = expert(idx[j]);
    const float* wg = W.data();
    const float* wu = wg + I * H;
    const float* wd = wu + I * H;
    for (int64_t i = 0; i < I; ++i) {
      float g = 0, u = 0;
      for (int64_t c = 0; c < H; ++c) {
        g += x[c] * wg[i * H + c];
        u += x[c] * wu[i * H + c];
      }
      g = round_bf16(g);
      u = round_bf16(u);
      h[i] = round_bf16(g / (1.0f + std::exp(-g)) * u);
    }
    for (int64_t c = 0; c < H; ++c) {
      float y = 0;
      for (int64_t i = 0; i < I; ++i) y += h[i] * wd[c * I + i];
      acc[c] = std::fma(wt[j], round_bf16(y), acc[c]);
    }
  }
  for (auto& v : acc) v = round_bf16(v);
  return acc;
}

}  // namespace

int run_gpu_layer_bench(const GpuBenchOptions& o) {
  const int W = gpu_count();
  MOK_REQUIRE(W >= 1, "GPUs", "the GPU benchmark needs at least one visible GPU");
  MOK_REQUIRE(o.iters >= 20, "--iters", "at least 20 timed iterations are required, got ", o.iters);
  std::vector<int> devices(static_cast<size_t>(W));
  for (int g = 0; g < W; ++g) devices[static_cast<size_t>(g)] = g;
  Config cfg;
  cfg.fwd_comm_sms = o.comm_sms;
  comm::CommOptions copt;
  copt.config = cfg;
  std::printf("[mok_bench] GPU layer (unfused path) on %d x %s, EP %d, %d comm SMs, %d warm-up + %d timed iterations\n",
              W, device_name().c_str(), W, o.comm_sms, o.warmup, o.iters);
  auto group = comm::LocalGroup::create(devices, copt);
  std::string cases;
  std::printf("| model | T/rank | routing | check rel err | mok ms (slowest rank, median) | TFLOP/s per GPU |\n|---|---|---|---|---|---|\n");
  for (const auto& name : o.models) {
    const Model* m = nullptr;
    for (const auto& c : kModels)
      if (name == c.name) m = &c;
    MOK_REQUIRE(m != nullptr, "--models", "unknown model '", name, "' (dsv3, qwen3-30b-a3b, qwen3-235b)");
    MOK_REQUIRE(m->E % W == 0, "GPUs", m->name, " has ", m->E, " experts, not divisible by ", W, " ranks");
    const int64_t H = m->H, I = m->I, k = m->k, e_loc = m->E / W;
    std::vector<RankWeights> weights(static_cast<size_t>(W));
    group.run([&](comm::Communicator& c, size_t r) {
      RankWeights& rw = weights[r];
      const size_t n = static_cast<size_t>(e_loc * I * H);
      MOK_CUDA_CHECK(cudaMalloc(&rw.gate, n * 2));
      MOK_CUDA_CHECK(cudaMalloc(&rw.up, n * 2));
      MOK_CUDA_CHECK(cudaMalloc(&rw.down, n * 2));
      gpu::fill_normal_bf16(rw.gate, static_cast<int64_t>(n), 3 * r + 1, 1.0f / std::sqrt(float(H)), c.stream());
      gpu::fill_normal_bf16(rw.up, static_cast<int64_t>(n), 3 * r + 2, 1.0f / std::sqrt(float(H)), c.stream());
      gpu::fill_normal_bf16(rw.down, static_cast<int64_t>(n), 3 * r + 3, 1.0f / std::sqrt(float(I)), c.stream());
      MOK_CUDA_CHECK(cudaStreamSynchronize(c.stream()));
    });
    for (int64_t T : o.tokens) {
      for (Routing routing : o.routings) {
        const LayerShape shape = LayerShape::uniform(W, T, H, I, m->E, k, 0);
        const Workload wl = make_workload(shape, routing, 2026 + static_cast<uint64_t>(T), 0);
        std::vector<std::vector<double>> ms(static_cast<size_t>(W));
        std::vector<std::vector<bf16>> sampled(static_cast<size_t>(W));
        const int64_t samples[2] = {0, T / 2 + 1};
        group.run([&](comm::Communicator& c, size_t r) {
          const auto& in = wl.inputs[r];
          void *x = nullptr, *idx = nullptr, *w = nullptr, *out = nullptr;
          MOK_CUDA_CHECK(cudaMalloc(&x, in.x.size() * 2));
          MOK_CUDA_CHECK(cudaMalloc(&idx, in.topk_idx.size() * 4));
          MOK_CUDA_CHECK(cudaMalloc(&w, in.topk_w.size() * 4));
          MOK_CUDA_CHECK(cudaMalloc(&out, static_cast<size_t>(T * H) * 2));
          MOK_CUDA_CHECK(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
          MOK_CUDA_CHECK(cudaMemcpy(idx, in.topk_idx.data(), in.topk_idx.size() * 4, cudaMemcpyHostToDevice));
          MOK_CUDA_CHECK(cudaMemcpy(w, in.topk_w.data(), in.topk_w.size() * 4, cudaMemcpyHostToDevice));
          const RankWeights& rw = weights[r];
          DeviceWeights dw{rw.gate, rw.up, rw.down, nullptr, nullptr, nullptr};
          Layer layer(c, shape, cfg, dw);
          RoutingRefs refs{TensorRef::contiguous(x, DType::BF16, {T, H}),
                           TensorRef::contiguous(idx, DType::I32, {T, k}),
                           TensorRef::contiguous(w, DType::F32, {T, k})};
          cudaStream_t s = c.stream();
          MOK_CUDA_CHECK(cudaMemsetAsync(out, 0xff, static_cast<size_t>(T * H) * 2, s));  // poison
          layer.forward(refs, out, s);
          MOK_CUDA_CHECK(cudaStreamSynchronize(s));
          layer.check();
          for (int64_t t : samples) {
            const size_t at = sampled[r].size();
            sampled[r].resize(at + static_cast<size_t>(H));
            MOK_CUDA_CHECK(cudaMemcpy(sampled[r].data() + at, static_cast<bf16*>(out) + t * H, H * 2, cudaMemcpyDeviceToHost));
          }
          std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * (o.warmup + o.iters)));
          for (auto& e : ev) MOK_CUDA_CHECK(cudaEventCreate(&e));
          for (int it = 0; it < o.warmup + o.iters; ++it) {
            MOK_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(2 * it)], s));
            layer.forward(refs, out, s);
            MOK_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(2 * it + 1)], s));
          }
          MOK_CUDA_CHECK(cudaStreamSynchronize(s));
          layer.check();
          for (int it = o.warmup; it < o.warmup + o.iters; ++it) {
            float e = 0;
            MOK_CUDA_CHECK(cudaEventElapsedTime(&e, ev[static_cast<size_t>(2 * it)], ev[static_cast<size_t>(2 * it + 1)]));
            ms[r].push_back(e);
          }
          for (auto& e : ev) cudaEventDestroy(e);
          for (void* p : {x, idx, w, out}) cudaFree(p);
        });
        // Sampled check against the spec's arithmetic (2 tokens per rank, all their experts).
        double num = 0, den = 0;
        std::map<int64_t, std::vector<float>> cache;
        for (int r = 0; r < W; ++r) {
          const auto& in = wl.inputs[static_cast<size_t>(r)];
          for (int q = 0; q < 2; ++q) {
            const int64_t t = samples[q];
            std::vector<float> xv(static_cast<size_t>(H));
            for (int64_t c = 0; c < H; ++c) xv[c] = float(in.x[t * H + c]);
            const auto want = expected_token(*m, weights, e_loc, xv, &in.topk_idx[t * k], &in.topk_w[t * k], cache);
            for (int64_t c = 0; c < H; ++c) {
              const double a = float(sampled[r][q * H + c]), b = want[c];
              num += std::isnan(a) ? INFINITY : (a - b) * (a - b);
              den += b * b;
            }
          }
        }
        const double rel = std::sqrt(num / std::max(den, 1e-30));
        MOK_REQUIRE(rel < 1e-2, "GPU layer check", "sampled outputs must match the spec within 1e-2 (",
                    m->name, " T=", T, " ", to_string(routing), ": rel err ", rel, ")");
        std::vector<double> slowest(static_cast<size_t>(o.iters), 0.0);
        for (int r = 0; r < W; ++r)
          for (int it = 0; it < o.iters; ++it) slowest[it] = std::max(slowest[it], ms[r][it]);
        const double t_ms = median(slowest);
        const double flops = 2.0 * double(T) * double(k) * 3.0 * double(H) * double(I);  // per GPU
        const double tflops = flops / (t_ms * 1e-3) / 1e12;
        std::printf("| %s | %lld | %s | %.1e | %.3f | %.0f |\n", m->name, (long long)T, to_string(routing), rel, t_ms, tflops);
        std::fflush(stdout);
        if (!cases.empty()) cases += ",\n    ";
        cases += "{\"model\": \"" + std::string(m->name) + "\", \"T\": " + std::to_string(T) +
                 ", \"routing\": \"" + to_string(routing) + "\", \"variant\": \"unfused\", \"mok_ms\": " +
                 std::to_string(t_ms) + ", \"mok_tflops\": " + std::to_string(tflops) +
                 ", \"comm_sms\": " + std::to_string(o.comm_sms) + ", \"minibatch_tokens\": " +
                 std::to_string(cfg.resolved_minibatch(shape)) + ", \"check_rel_err\": " + std::to_string(rel) + "}";
      }
    }
    group.run([&](comm::Communicator&, size_t r) {
      cudaFree(weights[r].gate);
      cudaFree(weights[r].up);
      cudaFree(weights[r].down);
    });
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << "{" << json_meta(W) << ", \"ep\": " << W
      << ", \"what\": \"mok GPU layer forward (unfused path), slowest rank per iteration, median of "
      << o.iters << " after " << o.warmup << " warm-up\", \"cases\": [\n    " << cases << "\n  ]}\n";
    std::printf("[mok_bench] wrote %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace mok::bench
