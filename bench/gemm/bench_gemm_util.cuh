// mok_gemm_bench's device fills and host fetch helpers (included by bench_gemm.cu only): random
// bf16 / E4M3 / scale fills on the device, the benchmark's device buffer, the skewed row counts,
// and the fetches its sampled fp64 checks read.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "mok/bf16.hpp"

namespace mok::bench_gemm {

__global__ void fill_kernel(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = (uint64_t(i) + seed * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 31;
    z *= 0x94D049BB133111EBull;
    z ^= z >> 29;
    const float u = float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
    const float v = u * scale;
    uint32_t b = __float_as_uint(v);
    b += 0x7fffu + ((b >> 16) & 1u);
    p[i] = uint16_t(b >> 16);
  }
}

// FP8 operands (fc2_fp8): finite E4M3 codes of magnitude 2^-3 .. 2^3 with random signs and
// mantissas, and power-of-two fp32 scales in [2^-4, 1].
__global__ void fill_e4m3_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t z = (uint64_t(i) + seed * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    const auto r = uint32_t(z >> 32);
    p[i] = uint8_t(((r & 1u) << 7) | ((4u + ((r >> 1) & 0xffu) % 7u) << 3) | ((r >> 12) & 7u));
  }
}
__global__ void fill_scales_kernel(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t z = (uint64_t(i) + seed * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    p[i] = ldexpf(1.0f, -int((z >> 40) % 5u));
  }
}

void fill(void* p, int64_t n, uint64_t seed, float scale) {
  fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed, scale);
  MOK_CUDA_CHECK(cudaGetLastError());
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { MOK_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

std::vector<int32_t> expert_counts(int64_t experts, int64_t per_expert, const std::string& routing) {
  std::vector<int32_t> c(static_cast<size_t>(experts), static_cast<int32_t>(per_expert));
  if (routing == "uniform") return c;
  // skewed: popularity ~ 1/(e+1)^1.2 (the workload generator's Zipf), counts in multiples of 16,
  // the same total rows as uniform.
  const int64_t total = experts * per_expert;
  double norm = 0;
  for (int64_t e = 0; e < experts; ++e) norm += std::pow(double(e + 1), -1.2);
  int64_t used = 0;
  for (int64_t e = 0; e < experts; ++e) {
    c[size_t(e)] = int32_t(int64_t(double(total) * std::pow(double(e + 1), -1.2) / norm) / 16 * 16);
    used += c[size_t(e)];
  }
  c[0] += int32_t(total - used);
  return c;
}

float host_bf16(uint16_t b) { return mok::bf16::to_float(b); }

std::vector<uint16_t> fetch(const void* base, int64_t offset_elems, int64_t n) {
  std::vector<uint16_t> v(size_t(std::max<int64_t>(n, 0)));
  MOK_CUDA_CHECK(cudaMemcpy(v.data(), static_cast<const uint16_t*>(base) + offset_elems, size_t(n) * 2,
                            cudaMemcpyDeviceToHost));
  return v;
}

double dot_rows(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(host_bf16(a[i])) * double(host_bf16(b[i]));
  return s;
}

// Strided gather of n elements (device) starting at `offset`, `stride` apart.
std::vector<uint16_t> fetch_strided(const void* base, int64_t offset, int64_t stride, int64_t n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  MOK_CUDA_CHECK(cudaMemcpy2D(v.data(), 2, static_cast<const uint16_t*>(base) + offset, size_t(stride) * 2, 2,
                              size_t(n), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace mok::bench_gemm
