// What mok_comm_bench's two translation units share. comm_bench.cu drives the run: options, the
// two ranks' buffers, the copy ceiling, the JSON file and the closing table. comm_measure.cu
// launches every kernel: pull / push bandwidth, the hand-off latency and the --probe runs; it is
// apart because copy_kernels.cuh defines its kernels in the header, so only one translation unit
// of the binary may include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "mok/comm.hpp"

namespace mok::bench::comm_bench {

// What the bandwidth runs sweep and the closing table lists: CTAs (one per SM) doing the copy, the
// hidden size of a row, and the copy kernels (bulk-async TMA or plain 16-byte loads / stores).
constexpr int kSmCounts[] = {4, 8, 16, 24, 32};
constexpr int kHiddens[] = {7168, 2048};
inline const std::vector<std::string> kMethods = {"tma", "ldst"};

struct Args {
  std::string out;
  std::string commit = "unknown";
  int reps = 10;
  bool quick = false;
  bool probe = false;  // per-SM and NVLink-counter probes instead of the main bench
};

inline uint32_t rows_for(int hidden) { return hidden >= 4096 ? 65536u : 262144u; }  // ~0.94 / 1.07 GB
// Hand-offs timed per latency run (after the warm-up ones); the JSON file records the number.
inline uint32_t timed_handoffs(const Args& args) { return args.quick ? 400 : 2000; }

struct Result {
  std::string mode, method;
  int hidden, sms;
  double gbps, ms;
  unsigned long long bad;
};

// Events belong to a device: record them only on that device's streams.
struct Timer {
  cudaEvent_t a, b;
  explicit Timer(int device) {
    MOK_CUDA_CHECK(cudaSetDevice(device));
    MOK_CUDA_CHECK(cudaEventCreate(&a));
    MOK_CUDA_CHECK(cudaEventCreate(&b));
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  double ms() const {
    float t = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    return t;
  }
};

// Per-rank buffers: local rows y, permutation, streams.
struct RankBuf {
  int dev;
  cudaStream_t s;
  void* y = nullptr;
  int* perm = nullptr;
  char* x_local = nullptr;  // this rank's window (host-side pointer: for fill/check kernels)
  char* x_peer = nullptr;   // the other rank's window as this GPU's kernels reach it
};

// NVLink hardware counters (nvidia-smi nvlink -gt d|r) around a known workload: bytes each way.
struct LinkRow {
  std::string name;
  double payload;
  double data[4], raw[4];  // GPU0 tx, GPU0 rx, GPU1 tx, GPU1 rx (bytes)
};

struct SmProbe {
  std::string name;
  double gbps[3];  // 1, 2, 4 SMs
};

struct Lat {
  std::string mode;
  int ctas;
  double us;
  unsigned long long bad, stored, loaded, flags;
  uint32_t hops_total;
};

// comm_measure.cu
void set_kernel_attributes(int device);
// copy_kernels.cuh's size of the hand-off window, for the driver, which cannot include it.
size_t sig_window_bytes();
// Rank 0 pulls from and pushes to GPU 1 at each hidden size, SM count and method, then both GPUs
// pull at once; every configuration's output is checked (Result::bad).
void measure_bandwidth(const std::vector<RankBuf>& rb, const Args& args, double ceiling, double bidir_each,
                       std::vector<Result>& results, std::vector<Result>& bidir);
std::vector<Lat> measure_latency(mok::comm::LocalGroup& group, const Args& args);
std::vector<SmProbe> run_sm_probes(const std::vector<RankBuf>& rb);
// full: the TMA copies too (--probe), not only the ld/st ones.
std::vector<LinkRow> run_link_probes(mok::comm::LocalGroup& group, const std::vector<RankBuf>& rb, bool full);

}  // namespace mok::bench::comm_bench
