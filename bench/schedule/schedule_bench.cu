// schedule_bench — time of the GPU routing schedule (publish + build) per rank at the model
// shapes, EP 2. Each GPU reads the other's published table over NVLink, as in the layer.
// Writes bench/results/schedule-<gpu>x<count>.json (path from argv[1]).
#include <cuda_runtime.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "util/bench_util.h"
#include "common/cuda_check.h"
#include "mok/workload.hpp"
#include "schedule/schedule_gpu.h"

namespace {

struct Model {
  const char* name;
  int64_t experts, top_k;
};
constexpr Model kModels[] = {{"dsv3", 256, 8}, {"qwen3-30b-a3b", 128, 8}, {"qwen3-235b", 128, 8}};

// Median time (us) of `reps` graph replays of publish + build on device `g`.
double time_rank(const mok::LayerShape& shape, const std::vector<int32_t*>& published,
                 int64_t* my_ids, int g, int reps) {
  MOK_CUDA_CHECK(cudaSetDevice(g));
  const int W = shape.world_size();
  const int32_t** d_tables = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&d_tables, W * sizeof(int32_t*)));
  MOK_CUDA_CHECK(cudaMemcpy(d_tables, published.data(), W * sizeof(int32_t*), cudaMemcpyHostToDevice));
  mok::gpu::ScheduleBuilder b(shape, mok::Config{}, g, d_tables);
  cudaStream_t s;
  MOK_CUDA_CHECK(cudaStreamCreate(&s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  mok::gpu::publish_routing(my_ids, true, nullptr, shape.tokens_of(g), shape.top_k, shape.experts, g,
                            published[g], nullptr, s);
  b.build(s);
  MOK_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOK_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  MOK_CUDA_CHECK(cudaEventCreate(&e0));
  MOK_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int i = 0; i < reps + 10; ++i) {
    MOK_CUDA_CHECK(cudaEventRecord(e0, s));
    MOK_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOK_CUDA_CHECK(cudaEventRecord(e1, s));
    MOK_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 10) us.push_back(ms * 1000.0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  cudaFree(d_tables);
  return mok::bench::median(us);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string out = argc > 1 ? argv[1] : "schedule.json";
    const int gpus = mok::bench::gpu_count();
    if (gpus < 1) {
      std::fprintf(stderr, "schedule_bench: no GPU visible\n");
      return 1;
    }
    const int W = 2;
    const bool real_peers = gpus >= 2;
    if (real_peers) {
      for (int g = 0; g < 2; ++g) {
        MOK_CUDA_CHECK(cudaSetDevice(g));
        const cudaError_t e = cudaDeviceEnablePeerAccess(1 - g, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) MOK_CUDA_CHECK(e);
        (void)cudaGetLastError();
      }
    } else {
      std::printf("[schedule_bench] one GPU: both ranks' tables live on GPU 0 (no NVLink reads)\n");
    }
    std::string cases;
    std::printf("| model | T | routing | rank 0 us | rank 1 us | schedule us (slowest) |\n|---|---|---|---|---|---|\n");
    for (const auto& m : kModels) {
      for (int64_t T : {2048, 8192}) {
        for (auto routing : {mok::Routing::Uniform, mok::Routing::Zipf}) {
          const auto shape = mok::LayerShape::uniform(W, T, 64, 64, m.experts, m.top_k);
          const auto wl = mok::make_workload(shape, routing, 7);
          std::vector<int32_t*> published(W);
          std::vector<int64_t*> ids(W);
          for (int r = 0; r < W; ++r) {
            MOK_CUDA_CHECK(cudaSetDevice(real_peers ? r : 0));
            const std::vector<int64_t> h(wl.inputs[r].topk_idx.begin(), wl.inputs[r].topk_idx.end());
            MOK_CUDA_CHECK(cudaMalloc(&ids[r], h.size() * sizeof(int64_t)));
            MOK_CUDA_CHECK(cudaMalloc(&published[r], h.size() * sizeof(int32_t)));
            MOK_CUDA_CHECK(cudaMemcpy(ids[r], h.data(), h.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
          }
          double t[2];
          for (int r = 0; r < W; ++r) t[r] = time_rank(shape, published, ids[r], real_peers ? r : 0, 100);
          const double slowest = std::max(t[0], t[1]);
          std::printf("| %s | %lld | %s | %.1f | %.1f | %.1f |\n", m.name, (long long)T,
                      mok::to_string(routing), t[0], t[1], slowest);
          if (!cases.empty()) cases += ",\n    ";
          cases += "{\"model\": \"" + std::string(m.name) + "\", \"T\": " + std::to_string(T) +
                   ", \"routing\": \"" + mok::to_string(routing) + "\", \"schedule_us\": " +
                   std::to_string(slowest) + ", \"rank_us\": [" + std::to_string(t[0]) + ", " +
                   std::to_string(t[1]) + "]}";
          for (int r = 0; r < W; ++r) {
            cudaSetDevice(real_peers ? r : 0);
            cudaFree(ids[r]);
            cudaFree(published[r]);
          }
        }
      }
    }
    std::ofstream f(out);
    f << "{" << mok::bench::json_meta(gpus) << ", \"ep\": " << W
      << ", \"peers\": \"" << (real_peers ? "nvlink" : "same-gpu") << "\""
      << ", \"what\": \"publish_routing + ScheduleBuilder::build as one CUDA graph, median of 100 replays per rank\""
      << ",\n  \"cases\": [\n    " << cases << "\n  ]\n}\n";
    std::printf("wrote %s\n", out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "schedule_bench: %s\n", e.what());
    return 1;
  }
}
