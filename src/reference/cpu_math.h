// Building blocks of the CPU reference: a deterministic thread split and fp32 GEMMs whose every
// output element is a plain sum in increasing k order (no fused multiply-add: the project builds
// host code with -ffp-contract=off). Vectorization runs across output columns, which never
// reorders a single element's sum, so results are bitwise independent of compiler vector width
// and of the number of threads.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "mok/bf16.hpp"

namespace mok::ref {

// Calls fn(begin, end) on contiguous pieces of [0, n) from `threads` threads (0 = hardware).
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn&& fn);

// C[M,N] = A[M,K] . B[K,N], fp32, row-major, each C element summed over k = 0..K-1 in order.
void matmul(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N, int threads);

// out[c, r] = in[r, c]
std::vector<float> transpose(const float* in, int64_t rows, int64_t cols);
std::vector<float> to_float(const bf16* in, int64_t n);
void round_in_place(float* v, int64_t n);  // v = rnd_bf16(v)

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

}  // namespace mok::ref

#include "reference/cpu_math_impl.h"
