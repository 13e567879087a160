// mok_bench — the main job: benchmark the MoE layer on all visible GPUs, or, on a machine without
// a GPU, run the CPU reference engine on simulated ranks (and say so), checked against the fp64
// model with a verdict (cpu_bench.h).
#include <algorithm>
#include <cstdio>
#include <thread>

#include "bench_args.h"
#include "cpu_bench.h"
#include "mok_bench_usage.h"  // generated from mok_bench_usage.txt (bench/CMakeLists.txt)
#include "util/bench_util.h"

int main(int argc, char** argv) {
  try {
    // Everything is parsed and checked first: a bad option stops the run before any work.
    const mok::bench::BenchArgs args = mok::bench::parse_bench_args({argv + 1, argv + argc});
    if (args.help) {
      std::fputs(kMokBenchUsage, stdout);
      return 0;
    }
    const int gpus = args.force_cpu ? 0 : mok::bench::gpu_count();
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
    return mok::bench::run_cpu_bench(c, threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
