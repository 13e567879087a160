// mok_bench's command line, parsed and checked before anything runs. Every bad value is an error
// naming the option and its constraint (one strict number parser for all options), and options
// of the mode that does not run (GPU options in CPU mode and the other way round) give a note
// instead of being dropped silently. scripts/run.sh only forwards its arguments here, so both
// report the same messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_layer_bench.h"
#include "mok/errors.hpp"
#include "util/parse_number.h"

namespace mok::bench {

// CPU presets: the model shapes scaled down so the reference finishes in seconds on 2 cores.
struct CpuPreset {
  const char* name;
  int world;  // simulated ranks when --ranks is not given
  int64_t T, H, I, E, k, Is;
};
inline constexpr CpuPreset kCpuPresets[] = {
    {"tiny", 2, 128, 128, 64, 8, 2, 64},
    {"small", 4, 256, 256, 128, 16, 4, 128},
    {"medium", 4, 512, 512, 256, 32, 4, 256},
};

struct CpuBenchOptions {
  const CpuPreset* preset = &kCpuPresets[2];
  int ranks = 0;  // resolved by parse_bench_args: the preset's world when not given
  Routing routing = Routing::Uniform;
  int threads = 0;  // 0 = all cores
  int reps = 3;
  std::string json;  // results file ("" = none); --json sets it and GpuBenchOptions::json
};

struct BenchArgs {
  bool help = false;
  bool force_cpu = false;
  CpuBenchOptions cpu;
  GpuBenchOptions gpu;  // its defaults are gpu_layer_bench.h's
  std::vector<std::string> given;  // options on the command line, first occurrence order (for notes)
};

// Bounds of the numeric options, shared by the parser and the tests.
inline constexpr int kMaxRanks = 4096;
inline constexpr int kMaxThreads = 1024;
inline constexpr int kMaxReps = 1000;
inline constexpr int64_t kMaxTokens = 1 << 20;
inline constexpr int kMinIters = 20;  // run_gpu_layer_bench's floor for a stable median
inline constexpr int kMaxIters = 100000;
inline constexpr int kMaxCommSms = 1024;
inline constexpr double kMaxSustainS = 600;

// Parses argv[1..] (without the program name). Throws mok::Error for an unknown option, a missing
// value, or a value out of its domain, naming the option. `--help` / `-h` anywhere wins.
BenchArgs parse_bench_args(const std::vector<std::string>& args);

// One note per given option that `gpu_mode` does not use, e.g.
// "note: --comm-sms applies on GPUs only; ignored in CPU mode".
std::vector<std::string> mode_notes(const BenchArgs& args, bool gpu_mode);

// Every option the parser knows, for the tests (the usage text must list each of them).
std::vector<std::string> bench_option_names();

}  // namespace mok::bench
