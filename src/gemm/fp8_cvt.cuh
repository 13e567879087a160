// mok — the hardware fp32 -> E4M3 conversion (sm_89+): two values per instruction,
// cvt.rn.satfinite.e4m3x2.f32, which is fp8::e4m3_encode bit for bit (round to nearest even,
// ±448 for anything beyond and for ±Inf, 0x7F for NaN; tests/gpu/gemm/test_fp8_quantize.cu checks
// all 2^32 inputs on the device). The software encode costs ~20 integer instructions per value;
// an epilogue that converts a whole tile cannot afford that while the tensor cores wait.
#pragma once

#include <cstdint>

#include "common/fp8_format.h"

namespace mok::gemm {

// {e4m3(lo), e4m3(hi)} with lo in the low byte (the order in memory of two adjacent elements).
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t d;
  // The PTX operand order: the first source goes to the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ uint8_t e4m3(float v) { return uint8_t(e4m3x2(v, 0.0f)); }

// Block-scaled codes of two adjacent elements of one block (fp8::block_encode_inv, twice).
__device__ __forceinline__ uint16_t block_encode_inv2(float lo, float hi, float inverse) {
  return e4m3x2(lo * inverse, hi * inverse);
}

}  // namespace mok::gemm
