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

// Two E4M3 codes (lo in the low byte) moved by a power of two f = 2^d, d <= 0: {e4m3(decode(lo) f),
// e4m3(decode(hi) f)}, the re-blocking rule of fp8::reblock_mxfp8 (an MX code re-encoded at its
// block's larger scale), in three conversions instead of a software decode per value. E4M3 -> f16
// is exact; the product in f16 is exact wherever the result is at least E4M3's smallest half-step
// 2^-10 (four significant bits, f16 normal down to 2^-14), and a product below it rounds to a
// zero of its sign either way (f16 may round it, never up to 2^-10); f under 2^-24 becomes 0 in f16,
// where every product is below 2^-10 already (codes are at most 448 < 2^9, and 2^(9-24) < 2^-10).
// tests/gpu/gemm/test_fp8_quantize.cu checks every code and shift against the spec.
__device__ __forceinline__ uint16_t e4m3x2_shifted(uint16_t codes, float f) {
  uint32_t h2, fh;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(codes));
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(fh) : "f"(f));
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h2) : "r"(fh));
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(h2));
  return d;
}

// The factor 2^(sc - top) <= 1 that moves an MX code at E8M0 scale code `sc` to its block's
// largest code `top` (0 below fp32's range, as fp8::reblock_mxfp8 has it).
__device__ __forceinline__ float mx_shift(uint32_t sc, uint32_t top) {
  const int d = int(sc) - int(top);
  return d >= -149 ? fp8::detail::pow2(d) : 0.0f;
}

// Two values' MX codes at E8M0 inverse scale `inv`, moved to the block's scale by f (above).
__device__ __forceinline__ uint16_t mx_reblocked2(float lo, float hi, float inv, float f) {
  return e4m3x2_shifted(e4m3x2(lo * inv, hi * inv), f);
}

// Block-scaled codes of two adjacent elements of one block (fp8::block_encode_inv, twice).
__device__ __forceinline__ uint16_t block_encode_inv2(float lo, float hi, float inverse) {
  return e4m3x2(lo * inverse, hi * inverse);
}

}  // namespace mok::gemm
