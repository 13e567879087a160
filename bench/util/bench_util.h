// Shared by the benchmarks: run metadata for results/*.json and robust statistics.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

namespace mok::bench {

// The commit being measured: MOK_COMMIT from the environment (the GPU machine receives a copy
// of the working tree without .git, so the caller passes it), else "unknown".
inline std::string commit() {
  const char* c = std::getenv("MOK_COMMIT");
  return c && *c ? c : "unknown";
}

inline std::string utc_date() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

inline std::string device_name(int dev = 0) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "unknown";
  return p.name;
}

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// JSON header fields every results file carries.
inline std::string json_meta(int gpus) {
  return "\"device\": \"" + device_name() + "\", \"gpus\": " + std::to_string(gpus) +
         ", \"date\": \"" + utc_date() + "\", \"commit\": \"" + commit() + "\"";
}

}  // namespace mok::bench
