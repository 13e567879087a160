#include "reference/cpu_math.h"

namespace mok::ref {

void matmul(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N, int threads) {
  constexpr int64_t kRows = 4;  // rows per block: B is streamed once per block
  const int64_t blocks = (M + kRows - 1) / kRows;
  parallel_for(blocks, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * kRows, r1 = std::min(M, r0 + kRows);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t n = 0; n < N; ++n) C[r * N + n] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float* b = B + k * N;
        for (int64_t r = r0; r < r1; ++r) {
          const float a = A[r * K + k];
          float* c = C + r * N;
          for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
        }
      }
    }
  });
}

std::vector<float> transpose(const float* in, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = in[r * cols + c];
  return out;
}

std::vector<float> to_float(const bf16* in, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<float>(in[i]);
  return out;
}

void round_in_place(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]);
}

}  // namespace mok::ref
