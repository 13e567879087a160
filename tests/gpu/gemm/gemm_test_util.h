// Helpers shared by the GEMM engine's GPU tests.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/workload.hpp"

namespace mok::test {

// Device buffer owning `bytes` bytes.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) {
    if (cudaMalloc(&p, n == 0 ? 16 : n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <typename T>
void upload(DevBuf& d, const std::vector<T>& v) {
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const DevBuf& d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaSuccess, cudaMemcpy(v.data(), d.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

inline uint16_t bits_of(float f) { return bf16::from_float(f); }
inline float float_of(uint16_t b) { return bf16::to_float(b); }
constexpr uint16_t kNaNBits = 0xFFFF;  // poison: a NaN bf16

// Random bf16 values (approximately N(0, scale^2)), never all zero.
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = bits_of(float(rng.normal() * scale));
  return v;
}

// The schedule's row layout for per-expert row counts: segments padded to 128 rows.
struct Routed {
  std::vector<int32_t> counts, begin, tile_expert;
  int64_t rows = 0;  // padded rows in total
  explicit Routed(const std::vector<int32_t>& c) : counts(c) {
    for (size_t e = 0; e < c.size(); ++e) {
      begin.push_back(int32_t(rows));
      const int64_t tiles = (c[e] + 127) / 128;
      for (int64_t t = 0; t < tiles; ++t) tile_expert.push_back(int32_t(e));
      rows += tiles * 128;
    }
  }
  int64_t num_m_tiles() const { return rows / 128; }
  // Expert of routed row r, or -1 for a padding row.
  int expert_of(int64_t r) const {
    for (size_t e = 0; e < counts.size(); ++e)
      if (r >= begin[e] && r < begin[e] + counts[e]) return int(e);
    return -1;
  }
};

// Routed activations [rows, cols]: random in real rows, NaN in padding rows.
inline std::vector<uint16_t> routed_input(const Routed& rt, int64_t cols, uint64_t seed) {
  auto v = random_bf16(size_t(rt.rows * cols), seed);
  for (int64_t r = 0; r < rt.rows; ++r)
    if (rt.expert_of(r) < 0)
      for (int64_t c = 0; c < cols; ++c) v[size_t(r * cols + c)] = kNaNBits;
  return v;
}

inline std::vector<double> to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = float_of(v[i]);
  return d;
}

// Accumulates ||got - ref||^2 and ||ref||^2 and counts non-finite values.
struct ErrStat {
  double diff2 = 0, ref2 = 0, max_abs = 0;
  int64_t nonfinite = 0, count = 0;
  void add(double got, double ref) {
    ++count;
    if (!std::isfinite(got)) {
      ++nonfinite;
      return;
    }
    diff2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
    max_abs = std::max(max_abs, std::fabs(got - ref));
  }
  double rel() const { return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2); }
};

// Elements whose bits differ (floats compared as bit patterns: NaN equals itself, -0 is not 0).
inline int64_t count_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
  return d;
}
inline int64_t count_diff(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return d;
}

// bf16 steps between two bf16 values (their distance in the ordered encoding).
inline int bf16_steps_apart(uint16_t a, uint16_t b) {
  const auto ordered = [](uint16_t x) { return (x & 0x8000) ? -int(x & 0x7fff) : int(x & 0x7fff); };
  return std::abs(ordered(a) - ordered(b));
}

}  // namespace mok::test
