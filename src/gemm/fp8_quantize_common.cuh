// mok — the small device helpers the FP8 quantization kernels share (fp8_quantize.cu: rows, tiles,
// token blocks; fp8_quantize_weights.cu: the dgrads' transposed weight codes). Internal.
#pragma once

#include <cstdint>

#include "common/fp8_format.h"
#include "mok/errors.hpp"

namespace mok::gemm::quant {

__device__ __forceinline__ float bf16_at(const uint16_t* p) { return __uint_as_float(uint32_t(*p) << 16); }

// The maximum of a warp's magnitudes (fp8::amax_update: an unsigned maximum of the bits, NaN winning).
__device__ __forceinline__ float warp_amax(float a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fp8::amax_update(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

constexpr int kTileThreads = 256;  // the 128 x 128 (and 128 x 1 token-block) kernels' CTA

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// What every entry point checks: sizes >= 0, and the pointers where there are elements.
inline void check_args(const void* in, int64_t rows, int64_t cols, const void* q, const void* scales) {
  MOK_REQUIRE(rows >= 0, "rows", "rows >= 0 (rows = ", rows, ")");
  MOK_REQUIRE(cols >= 0, "cols", "cols >= 0 (cols = ", cols, ")");
  const bool any = rows > 0 && cols > 0;
  MOK_REQUIRE(!any || in != nullptr, "in", "not null when rows * cols > 0");
  MOK_REQUIRE(!any || q != nullptr, "q", "not null when rows * cols > 0");
  MOK_REQUIRE(!any || scales != nullptr, "scales", "not null when rows * cols > 0");
}

}  // namespace mok::gemm::quant
