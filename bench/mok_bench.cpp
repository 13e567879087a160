// mok_bench — the main job: benchmark the MoE layer on all visible GPUs, or, on a machine without
// a GPU, run the CPU reference engine on simulated ranks (and say so).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef MOK_HAVE_GPU_LAYER
#include "gpu_layer_bench.h"
#endif
#include "mok/errors.hpp"
#include "mok/reference.hpp"
#include "mok/schedule.hpp"
#include "mok/workload.hpp"

namespace {

struct Preset {
  const char* name;
  int world;
  int64_t T, H, I, E, k, Is;
};

// CPU presets: the model shapes scaled down so the reference finishes in seconds on 2 cores.
constexpr Preset kCpuPresets[] = {
    {"tiny", 2, 128, 128, 64, 8, 2, 64},
    {"small", 4, 256, 256, 128, 16, 4, 128},
    {"medium", 4, 512, 512, 256, 32, 4, 256},
};

void usage() {
  std::printf(
      "usage: mok_bench [GPU options] | --cpu [CPU options]\n"
      "Runs the MoE layer benchmark on all visible GPUs (one EP rank per GPU); without a GPU (or\n"
      "with --cpu) runs the CPU reference engine on W simulated ranks.\n"
      "GPU options: --models dsv3,qwen3-30b-a3b,qwen3-235b  --tokens 2048,8192\n"
      "             --routings uniform,zipf  --iters N (>= 20)  --warmup N  --comm-sms N  --json FILE\n"
      "             --path megakernel|unfused  --clusters 0|1  --dispatch pull|push  --no-ablation\n"
      "             --sustain SECONDS (main variant, back-to-back; 0 = off, default 4)  --no-backward\n"
      "CPU options: --preset tiny|small|medium  --ranks W  --routing uniform|zipf|one-expert|\n"
      "             one-rank|empty-slots  --threads N  --reps N\n");
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    const size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

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

int run_cpu(const Preset& p, int world, mok::Routing routing, int threads, int reps) {
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
  std::string preset = "medium", routing = "uniform";
  int world = 0, threads = 0, reps = 3;
  bool force_cpu = false;
  std::string models, tokens, routings, json;
  int iters = 20, warmup = 5, comm_sms = 0, clusters = -1;
  std::string path = "megakernel", dispatch = "pull";
  bool ablation = true, backward = true;
  double sustain = 4.0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mok_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--preset") preset = value();
    else if (a == "--ranks") world = std::atoi(value().c_str());
    else if (a == "--routing") routing = value();
    else if (a == "--threads") threads = std::atoi(value().c_str());
    else if (a == "--reps") reps = std::atoi(value().c_str());
    else if (a == "--cpu") force_cpu = true;
    else if (a == "--models") models = value();
    else if (a == "--tokens") tokens = value();
    else if (a == "--routings") routings = value();
    else if (a == "--iters") iters = std::atoi(value().c_str());
    else if (a == "--warmup") warmup = std::atoi(value().c_str());
    else if (a == "--comm-sms") comm_sms = std::atoi(value().c_str());
    else if (a == "--clusters") clusters = std::atoi(value().c_str());
    else if (a == "--json") json = value();
    else if (a == "--path") path = value();
    else if (a == "--dispatch") dispatch = value();
    else if (a == "--sustain") sustain = std::atof(value().c_str());
    else if (a == "--no-ablation") ablation = false;
    else if (a == "--no-backward") backward = false;
    else if (a == "--help" || a == "-h") { usage(); return 0; }
    else { std::fprintf(stderr, "mok_bench: unknown argument '%s'\n", a.c_str()); usage(); return 2; }
  }
  try {
    const Preset* p = nullptr;
    for (const auto& c : kCpuPresets)
      if (preset == c.name) p = &c;
    MOK_REQUIRE(p != nullptr, "--preset", "must be one of tiny, small, medium; got '", preset, "'");
    MOK_REQUIRE(reps >= 1, "--reps", "must be >= 1, got ", reps);
    const int gpus = gpu_count();
    if (gpus > 0 && !force_cpu) {
#ifdef MOK_HAVE_GPU_LAYER
      mok::bench::GpuBenchOptions o;
      if (!models.empty()) o.models = split_list(models);
      if (!tokens.empty()) {
        o.tokens.clear();
        for (const auto& t : split_list(tokens)) o.tokens.push_back(std::atoll(t.c_str()));
      }
      if (!routings.empty()) {
        o.routings.clear();
        for (const auto& r : split_list(routings)) o.routings.push_back(mok::routing_from_string(r));
      }
      o.iters = iters;
      o.warmup = warmup;
      o.comm_sms = comm_sms;
      MOK_REQUIRE(clusters >= -1 && clusters <= 1, "--clusters", "must be 0 or 1, got ", clusters);
      o.clusters = clusters;
      MOK_REQUIRE(path == "megakernel" || path == "unfused", "--path", "must be megakernel or unfused, got '", path, "'");
      o.path = path == "megakernel" ? mok::ForwardPath::Megakernel : mok::ForwardPath::Unfused;
      MOK_REQUIRE(dispatch == "pull" || dispatch == "push", "--dispatch", "must be pull or push, got '", dispatch, "'");
      o.dispatch = dispatch == "pull" ? mok::DispatchPath::Pull : mok::DispatchPath::Push;
      o.ablation = ablation;
      o.backward = backward;
      MOK_REQUIRE(sustain >= 0 && sustain <= 600, "--sustain", "must be in [0, 600] seconds, got ", sustain);
      o.sustain_s = sustain;
      o.json = json;
      return mok::bench::run_gpu_layer_bench(o);
#else
      std::printf("[mok_bench] %d GPU(s) visible, but this build has no GPU layer (NCCL or the GEMM "
                  "engine missing); running the CPU reference engine instead\n", gpus);
#endif
    } else if (!force_cpu) {
      std::printf("[mok_bench] no GPU visible: running the CPU reference engine on simulated ranks\n");
    }
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    return run_cpu(*p, world > 0 ? world : p->world, mok::routing_from_string(routing), threads, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
