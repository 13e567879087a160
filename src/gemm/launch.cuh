// mok — launcher shared by the per-form translation units.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "common/cuda_check.h"
#include "gemm/grouped_kernel.cuh"
#include "gemm/launchers.h"

namespace mok::gemm::detail {

template <int kBN, template <class> class FormT, bool kCluster>
void launch_cfg(const Plan& plan, cudaStream_t stream) {
  using C = engine::Cfg<kBN>;
  auto* kernel = &engine::grouped_gemm_kernel<C, FormT, kCluster>;
  // Per-device function attributes and limits: set/query once per device.
  static std::atomic<unsigned long long> configured{0};
  static std::atomic<int> max_clusters[64];
  int dev = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  const unsigned long long bit = 1ull << (dev & 63);
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[2];
  unsigned int nattr = 0;
  cfg.gridDim = dim3(unsigned(plan.grid));
  cfg.blockDim = dim3(engine::kThreads);
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cfg.stream = stream;
  if constexpr (kCluster) {
    attr[nattr].id = cudaLaunchAttributeClusterDimension;
    attr[nattr].val.clusterDim.x = 2;
    attr[nattr].val.clusterDim.y = 1;
    attr[nattr].val.clusterDim.z = 1;
    ++nattr;
  }
  cfg.attrs = attr;
  cfg.numAttrs = nattr;  // the occupancy query below sees the cluster shape only
  if ((configured.load() & bit) == 0) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(C::kSmemBytes)));
    if constexpr (kCluster) {
      int n = 0;
      MOK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
      max_clusters[dev & 63].store(n);
    }
    configured.fetch_or(bit);
  }
  if constexpr (kCluster) {
    // Every CTA of the persistent grid must be resident: at most the clusters that fit at once.
    const int fit = 2 * std::max(1, max_clusters[dev & 63].load());
    cfg.gridDim = dim3(unsigned(std::min(plan.grid, fit)));
    static std::atomic<bool> told{false};
    if (plan.grid > fit && !told.exchange(true))
      std::fprintf(stderr, "mok gemm: cluster grid limited to %d CTAs (%d asked)\n", fit, plan.grid);
  }
  if (plan.pdl) {
    attr[nattr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[nattr].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = ++nattr;
  }
  MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, plan.map_a, plan.map_b, plan.map_b_half, plan.map_d0,
                                    plan.map_d1, plan.map_a_hold, plan.map_b_hold, plan.params));
}

template <template <class> class FormT>
void launch_form(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  if (plan.cluster) {
    if (plan.block_n == 128)
      launch_cfg<128, FormT, true>(plan, stream);
    else
      launch_cfg<256, FormT, true>(plan, stream);
  } else {
    if (plan.block_n == 128)
      launch_cfg<128, FormT, false>(plan, stream);
    else
      launch_cfg<256, FormT, false>(plan, stream);
  }
}

}  // namespace mok::gemm::detail
