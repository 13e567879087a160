// Helpers shared by the GPU tests.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace mok::test {

inline int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Device copy of `n` host values (at least one element is allocated, so n = 0 is fine).
template <typename T>
T* upload(const T* h, size_t n) {
  T* d = nullptr;
  EXPECT_EQ(cudaSuccess, cudaMalloc(&d, std::max<size_t>(1, n) * sizeof(T)));
  if (n) EXPECT_EQ(cudaSuccess, cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
T* upload(const std::vector<T>& h) {
  return upload(h.data(), h.size());
}
template <typename T>
std::vector<T> download(const T* d, int64_t n) {
  std::vector<T> h(static_cast<size_t>(n));
  if (n > 0) EXPECT_EQ(cudaSuccess, cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
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
