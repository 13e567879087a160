// Helpers shared by the GPU tests.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

namespace mok::test {

inline int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace mok::test

// Skips the current test, loudly, when fewer than `n` GPUs are visible.
#define MOK_REQUIRE_GPUS(n)                                                                    \
  do {                                                                                         \
    const int mok_have_ = ::mok::test::visible_gpus();                                         \
    if (mok_have_ < (n)) {                                                                     \
      std::fprintf(stderr, "SKIPPED: this test needs %d GPU(s), %d visible\n", (n), mok_have_); \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), " << mok_have_ << " visible";              \
    }                                                                                          \
  } while (0)

#define MOK_ASSERT_CUDA(expr) ASSERT_EQ(cudaSuccess, (expr)) << cudaGetErrorString(cudaGetLastError())
