// mok — launcher shared by the per-form translation units.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "common/cuda_check.h"
#include "gemm/grouped_gemm.h"
#include "gemm/grouped_kernel.cuh"

namespace mok::gemm::detail {

template <int kBN, template <class> class FormT>
void launch_cfg(const Plan& plan, cudaStream_t stream) {
  using C = engine::Cfg<kBN>;
  auto* kernel = &engine::grouped_gemm_kernel<C, FormT>;
  // The dynamic shared-memory limit is a per-device function attribute: set it once per device.
  static std::atomic<unsigned long long> configured{0};
  int dev = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  const unsigned long long bit = 1ull << (dev & 63);
  if ((configured.load() & bit) == 0) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(C::kSmemBytes)));
    configured.fetch_or(bit);
  }
  kernel<<<plan.grid, engine::kThreads, C::kSmemBytes, stream>>>(plan.map_a, plan.map_b, plan.map_d0,
                                                                  plan.map_d1, plan.params);
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <template <class> class FormT>
void launch_form(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  if (plan.block_n == 128)
    launch_cfg<128, FormT>(plan, stream);
  else
    launch_cfg<256, FormT>(plan, stream);
}

}  // namespace mok::gemm::detail
