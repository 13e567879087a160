// mok — turning CUDA runtime failures into mok::Error.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "mok/errors.hpp"

#define MOK_CUDA_CHECK(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t mok_err_ = (expr);                                                       \
    if (mok_err_ != cudaSuccess) {                                                             \
      throw ::mok::Error(::mok::ErrorKind::Runtime, #expr,                                     \
                         ::mok::detail::concat(cudaGetErrorName(mok_err_), ": ",               \
                                               cudaGetErrorString(mok_err_)),                  \
                         ::mok::detail::concat(__FILE__, ":", __LINE__));                      \
    }                                                                                          \
  } while (0)

namespace mok::detail {

// Sets `kernel`'s dynamic shared-memory limit to `bytes` once per device of this process (the
// attribute is per device; `done` is the caller's static per-kernel bit set of devices). For
// nvcc-compiled translation units (a __global__ function pointer).
template <typename Kernel>
void set_smem_once(Kernel kernel, int bytes, std::atomic<unsigned long long>& done) {
  int dev = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  const unsigned long long bit = 1ull << (dev & 63);
  if ((done.load() & bit) != 0) return;
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit);
}

}  // namespace mok::detail
