// The NVLink copy ceiling the benchmarks report GB/s against: cudaMemcpyPeerAsync of 1 GiB
// between two GPUs (the copy engines' direct path), timed with events on a stream of the
// destination GPU, median of 5 after 2 warm-up copies. Shared by comm_bench and mok_bench.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "util/bench_util.h"

namespace mok::bench {

inline constexpr size_t kPeerCopyBytes = size_t(1) << 30;

// Lets `dev` access `peer`'s memory, so cudaMemcpyPeer takes the direct NVLink path (NCCL may
// have enabled it already, which is fine). False when the pair has no peer access at all. Leaves
// `dev` current.
inline bool enable_peer_access(int dev, int peer) {
  int can = 0;
  MOK_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, dev, peer));
  if (!can) return false;
  MOK_CUDA_CHECK(cudaSetDevice(dev));
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clears exactly that error
    return true;
  }
  MOK_CUDA_CHECK(e);
  return true;
}

// GB/s of copying `bytes` from `src` (on src_dev) to `dst` (on dst_dev) on stream `s` of dst_dev:
// the median of `reps` timed copies after `warmup` untimed ones.
inline double peer_copy_GBps(void* dst, int dst_dev, const void* src, int src_dev, size_t bytes, cudaStream_t s,
                             int warmup = 2, int reps = 5) {
  MOK_CUDA_CHECK(cudaSetDevice(dst_dev));
  cudaEvent_t a, b;
  MOK_CUDA_CHECK(cudaEventCreate(&a));
  MOK_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    MOK_CUDA_CHECK(cudaEventRecord(a, s));
    MOK_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, bytes, s));
    MOK_CUDA_CHECK(cudaEventRecord(b, s));
    MOK_CUDA_CHECK(cudaEventSynchronize(b));
    float e = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&e, a, b));
    if (i >= warmup) ms.push_back(e);
  }
  MOK_CUDA_CHECK(cudaEventDestroy(a));
  MOK_CUDA_CHECK(cudaEventDestroy(b));
  const double m = median(ms);
  return m > 0 ? static_cast<double>(bytes) / (m * 1e-3) / 1e9 : 0.0;
}

struct PeerCopy {
  int src = 0, dst = 0;
  double GBps = 0;
};

// One-way copy rates between ring neighbours (r+1 -> r and r -> r+1 for every r: the directions
// in which rank r pulls and pushes at EP 2; at larger EP a sample of the links), each pair once.
// Allocates and frees 2 GiB per pair; devices 0..gpus-1. Empty below 2 GPUs; pairs without peer
// access are left out. The current device is restored.
inline std::vector<PeerCopy> neighbour_copy_rates(int gpus, size_t bytes = kPeerCopyBytes) {
  int prev = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&prev));
  std::set<std::pair<int, int>> pairs;
  for (int r = 0; gpus >= 2 && r < gpus; ++r) {
    pairs.insert({(r + 1) % gpus, r});
    pairs.insert({r, (r + 1) % gpus});
  }
  std::vector<PeerCopy> out;
  for (const auto& [src_dev, dst_dev] : pairs) {
    if (!enable_peer_access(dst_dev, src_dev) || !enable_peer_access(src_dev, dst_dev)) continue;
    void* src = nullptr;
    MOK_CUDA_CHECK(cudaMalloc(&src, bytes));  // on src_dev (current after enable_peer_access)
    MOK_CUDA_CHECK(cudaMemset(src, 1, bytes));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    MOK_CUDA_CHECK(cudaSetDevice(dst_dev));
    void* dst = nullptr;
    cudaStream_t s;
    MOK_CUDA_CHECK(cudaMalloc(&dst, bytes));
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    out.push_back({src_dev, dst_dev, peer_copy_GBps(dst, dst_dev, src, src_dev, bytes, s)});
    MOK_CUDA_CHECK(cudaStreamDestroy(s));
    MOK_CUDA_CHECK(cudaFree(dst));
    MOK_CUDA_CHECK(cudaSetDevice(src_dev));
    MOK_CUDA_CHECK(cudaFree(src));
  }
  MOK_CUDA_CHECK(cudaSetDevice(prev));
  return out;
}

// The ceiling: the largest one-way rate measured (as comm_bench reports it).
inline double copy_ceiling_GBps(const std::vector<PeerCopy>& rates) {
  double c = 0;
  for (const auto& r : rates) c = std::max(c, r.GBps);
  return c;
}

}  // namespace mok::bench
