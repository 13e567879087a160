// mok_bench — the main job: benchmark the MoE layer on all visible GPUs, or, on a machine without
// a GPU, run the CPU reference engine on simulated ranks (and say so).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench_args.h"
#include "mok/errors.hpp"
#include "mok/reference.hpp"
#include "mok/schedule.hpp"
#include "mok/workload.hpp"
#include "mok_bench_usage.h"  // generated from mok_bench_usage.txt (bench/CMakeLists.txt)

namespace {

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_cpu(const mok::bench::CpuPreset& p, int world, mok::Routing routing, int threads, int reps) {
  mok::LayerShape shape = mok::LayerShape::uniform(world, p.T, p.H, p.I, p.E, p.k, p.Is);
  mok::Config cfg;
  cfg.cpu_threads = threads;
  mok::ref::Engine engine(shape, cfg);
  std::printf("[mok_bench] building workload: preset %s, %d simulated ranks, %s routing\n", p.name,
              world, mok::to_string(routing));
  const mok::Workload wl = mok::make_workload(shape, routing, 2026);

  std::vector<double> fwd, bwd;
  int64_t routed_rows = 0, padded_rows = 0;
  mok::TileStats tiles;  // over all ranks
  for (int r = 0; r < reps; ++r) {
    std::printf("[mok_bench] repetition %d/%d: forward...", r + 1, reps);
    std::fflush(stdout);
    auto t0 = std::chrono::steady_clock::now();
    const auto res = engine.forward(wl.inputs, wl.weights);
    fwd.push_back(seconds_since(t0));
    std::printf(" %.3f s, backward...", fwd.back());
    std::fflush(stdout);
    t0 = std::chrono::steady_clock::now();
    (void)engine.backward(wl.inputs, wl.weights, wl.d_out);
    bwd.push_back(seconds_since(t0));
    std::printf(" %.3f s\n", bwd.back());
    routed_rows = padded_rows = 0;
    tiles = mok::TileStats{};
    for (const auto& s : res.schedules) {
      padded_rows += s.total_rows;
      for (int32_t n : s.expert_rows) routed_rows += n;
      const mok::TileStats t = mok::tile_stats(s);
      tiles.rows += t.rows;
      tiles.tiles += t.tiles;
      tiles.tiles_le32 += t.tiles_le32;
      tiles.tiles_le64 += t.tiles_le64;
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double f = median(fwd), b = median(bwd);
  const double tokens = double(shape.total_tokens());
  const double flops = 2.0 * double(routed_rows) * 3.0 * double(p.H) * double(p.I) +
                       2.0 * tokens * 3.0 * double(p.H) * double(p.Is);
  std::printf("\nCPU reference engine (the executable spec), %d simulated ranks, %d thread(s); "
              "not a GPU measurement\n", world, threads);
  std::printf("| preset | T/rank | H | I | E | k | Is | ranks | routing | routed rows | padded rows "
              "| M tiles (1-32 / 33-64 rows) | tile MMA / token rows (GPU, split-N) | fwd s | bwd s | fwd tokens/s "
              "| fwd GFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %lld | %lld | %lld | %lld | %lld | %lld | %d | %s | %lld | %lld | %lld (%lld / %lld) | %.3f "
              "| %.3f | %.3f | %.0f | %.2f |\n",
              p.name, (long long)p.T, (long long)p.H, (long long)p.I, (long long)p.E,
              (long long)p.k, (long long)p.Is, world, mok::to_string(routing),
              (long long)routed_rows, (long long)padded_rows, (long long)tiles.tiles, (long long)tiles.tiles_le32,
              (long long)tiles.tiles_le64, tiles.mma_over_useful(false), f, b, tokens / f, flops / f * 1e-9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // Everything is parsed and checked first: a bad option stops the run before any work.
    const mok::bench::BenchArgs args = mok::bench::parse_bench_args({argv + 1, argv + argc});
    if (args.help) {
      std::fputs(kMokBenchUsage, stdout);
      return 0;
    }
    const int gpus = args.force_cpu ? 0 : gpu_count();
#ifdef MOK_HAVE_GPU_LAYER
    const bool gpu_mode = gpus > 0;
#else
    const bool gpu_mode = false;
#endif
    for (const auto& note : mok::bench::mode_notes(args, gpu_mode)) std::fprintf(stderr, "[mok_bench] %s\n", note.c_str());
#ifdef MOK_HAVE_GPU_LAYER
    if (gpu_mode) return mok::bench::run_gpu_layer_bench(args.gpu);
#endif
    if (gpus > 0) {
      std::printf("[mok_bench] %d GPU(s) visible, but this build has no GPU layer (NCCL or the GEMM "
                  "engine missing); running the CPU reference engine instead\n", gpus);
    } else if (!args.force_cpu) {
      std::printf("[mok_bench] no GPU visible: running the CPU reference engine on simulated ranks\n");
    }
    const mok::bench::CpuBenchOptions& c = args.cpu;
    const int threads = c.threads > 0 ? c.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    return run_cpu(*c.preset, c.ranks, c.routing, threads, c.reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
