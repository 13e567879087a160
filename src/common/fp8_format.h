// mok — the FP8 formats as an executable specification, shared by the CPU reference and the GPU
// kernels (host and device code alike; nothing here depends on either side).
//
// What is defined here, element by element (the array loops are src/reference/fp8_quant.*, the
// reasoning and the choices are notes/fp8.md):
//   * E4M3, the OCP FP8 "fn" variant Hopper's tensor cores read: bias 7, no infinities, one NaN
//     pattern per sign (S.1111.111), largest finite 448 = 1.75 * 2^8, smallest subnormal 2^-9.
//     Conversion from fp32 is the one cvt.rn.satfinite.e4m3x2.f32 performs: round to nearest,
//     ties to even; a finite value beyond ±448 and ±Inf saturate to ±448; NaN becomes 0x7F;
//     the sign of zero (and of anything that rounds to zero) is kept. (Equal to CUDA 13's host
//     model of that instruction, and to the instruction itself on an H200, on all 2^32 inputs.)
//   * E8M0, the OCP MX scale: an unsigned biased exponent, value 2^(code - 127), 0xFF = NaN.
//   * MXFP8 (OCP Microscaling Formats v1.0, E4M3 elements, blocks of 32): the shared scale of a
//     block and the element conversion.
//   * The block-scaled FP8 of the DeepSeek-V3 recipe (1x128 activation blocks, 128x128 weight
//     blocks, one fp32 scale per block), with the fp32 scale amax / 448 or that scale rounded up
//     to a power of two.
//
// Every function is constexpr and works on bit patterns with integer arithmetic, apart from fp32
// products by powers of two (exact) and the division the block-scaled recipe defines, so its
// result is the same with any host compiler and in device code. Device code using it must keep
// IEEE division and fp32 subnormals (no --use_fast_math, -ftz=true or -prec-div=false): MX
// scales reach 2^-127 and their products are subnormal. A GPU kernel may use the hardware
// conversion instead of e4m3_encode (gemm/fp8_cvt.cuh: it is faster); the GPU test
// Fp8Cvt.HardwareConversionIsTheSpec checks that the two agree on all 2^32 fp32 inputs.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_FP8_HD __host__ __device__ __forceinline__
#else
#define MOK_FP8_HD inline
#endif

namespace mok::fp8 {

// ---- E4M3 ---------------------------------------------------------------------------------------

inline constexpr float kE4m3Max = 448.0f;      // largest finite magnitude, 1.75 * 2^8
inline constexpr int kE4m3Emax = 8;            // exponent of the largest normal (MX's emax_elem)
inline constexpr uint8_t kE4m3MaxCode = 0x7e;  // +448
// What every NaN input becomes (sign cleared, as CUDA's conversion does).
inline constexpr uint8_t kE4m3NaN = 0x7f;

namespace detail {

// The builtin behind std::bit_cast, called directly: std::bit_cast itself is a host function to
// nvcc, usable in device code only with --expt-relaxed-constexpr, which consumers may not set.
MOK_FP8_HD constexpr uint32_t bits(float f) { return __builtin_bit_cast(uint32_t, f); }
MOK_FP8_HD constexpr float from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

inline constexpr uint32_t kAbsMask = 0x7fffffffu;
inline constexpr uint32_t kInfBits = 0x7f800000u;
inline constexpr uint32_t kQuietNaNBits = 0x7fc00000u;

// 2^e exactly, for e in [-149, 127] (fp32 subnormals included).
MOK_FP8_HD constexpr float pow2(int e) {
  return e >= -126 ? from_bits(static_cast<uint32_t>(e + 127) << 23) : from_bits(1u << (e + 149));
}

// floor(log2(a)) and the significand of a normalized to [2^23, 2^24), for finite a > 0, read off
// the bits. Exact by construction, unlike floor(log2f(a)): the largest fp32 below 2^k has
// log2 = k - 8.6e-8, which fp32 rounds to k (k >= 2), one binade too high.
struct Binade {
  int exponent;  // floor(log2(a))
  uint32_t sig;  // a = sig * 2^(exponent - 23), 2^23 <= sig < 2^24
};
MOK_FP8_HD constexpr Binade binade(float a) {
  uint32_t u = bits(a) & kAbsMask;
  if (u >= 0x00800000u) return {static_cast<int>(u >> 23) - 127, (u & 0x007fffffu) | 0x00800000u};
  int e = -126;  // fp32 subnormal: shift the significand up to normal position
  while ((u & 0x00800000u) == 0) {
    u <<= 1;
    --e;
  }
  return {e, u};
}

}  // namespace detail

// fp32 -> E4M3, round to nearest even, saturating (see the header comment for the special cases).
MOK_FP8_HD constexpr uint8_t e4m3_encode(float f) {
  const uint32_t u = detail::bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & detail::kAbsMask;
  if (a > detail::kInfBits) return kE4m3NaN;
  // Every |f| >= 448 (Inf included) gives 448: below 464 by rounding, 464 itself is the tie
  // between 448 (even mantissa 110) and 480 (which does not exist), and beyond that satfinite.
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | kE4m3MaxCode);
  if (a >= 0x3c800000u) {
    // |f| >= 2^-6, normal E4M3: rebias the exponent from 127 to 7, keep the top 3 mantissa bits
    // and round the 20 dropped ones to nearest even. A carry out of the mantissa steps the
    // exponent, which is exactly the next E4M3 value; below 448 it cannot reach the NaN pattern.
    const uint32_t r = a - (120u << 23);
    uint32_t code = r >> 20;
    const uint32_t dropped = r & 0xfffffu;
    if (dropped > 0x80000u || (dropped == 0x80000u && (code & 1u) != 0)) ++code;
    return static_cast<uint8_t>(sign | code);
  }
  // |f| < 2^-6: E4M3 subnormals k * 2^-9, k = round_even(|f| * 2^9) in [0, 8]. k = 8 is 2^-6,
  // whose code 0x08 is the smallest normal: the code space is continuous across the boundary.
  if (a < 0x00800000u) return sign;  // fp32 zero or subnormal (< 2^-126): rounds to a signed zero
  const int e = static_cast<int>(a >> 23) - 127;         // <= -7
  const uint32_t sig = (a & 0x007fffffu) | 0x00800000u;  // |f| = sig * 2^(e - 23)
  const int shift = 14 - e;                              // |f| * 2^9 = sig * 2^-shift, >= 21
  if (shift > 24) return sign;  // |f| * 2^9 < 2^24 * 2^-25 = 1/2: rounds to zero
  uint32_t k = sig >> shift;
  const uint32_t dropped = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (dropped > half || (dropped == half && (k & 1u) != 0)) ++k;
  return static_cast<uint8_t>(sign | k);
}

// E4M3 -> fp32, exact (every E4M3 value is an fp32 value). Both NaN codes give a quiet NaN of
// the code's sign.
MOK_FP8_HD constexpr float e4m3_decode(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;  // exponent and mantissa fields, 4 + 3 bits
  if (em == 0x7fu) return detail::from_bits(sign | detail::kQuietNaNBits);
  // Normal: rebias 7 -> 127 (add 120 to the exponent field) and widen the mantissa to 23 bits.
  if (em >= 0x08u) return detail::from_bits(sign | ((em + (120u << 3)) << 20));
  // Subnormal m * 2^-9 (m = 0..7): the product is exact; the sign goes on afterwards so that
  // code 0x80 gives -0.
  return detail::from_bits(sign | detail::bits(static_cast<float>(em) * 0x1p-9f));
}

MOK_FP8_HD constexpr bool e4m3_is_nan(uint8_t c) { return (c & 0x7fu) == 0x7fu; }

// ---- E8M0 ---------------------------------------------------------------------------------------

inline constexpr int kE8m0Bias = 127;
inline constexpr uint8_t kE8m0NaN = 0xff;
inline constexpr int kE8m0MinExponent = -127;  // code 0
inline constexpr int kE8m0MaxExponent = 127;   // code 254

// 2^(c - 127) exactly (code 0 is 2^-127, an fp32 subnormal); 0xFF gives NaN.
MOK_FP8_HD constexpr float e8m0_decode(uint8_t c) {
  if (c == kE8m0NaN) return detail::from_bits(detail::kQuietNaNBits);
  if (c == 0) return detail::from_bits(0x00400000u);
  return detail::from_bits(static_cast<uint32_t>(c) << 23);  // exponent field = code, mantissa 0
}

// The code of 2^e for e in [-127, 127]; anything outside has no encoding and gives NaN (the MX
// scale computation clamps before it gets here).
MOK_FP8_HD constexpr uint8_t e8m0_from_exponent(int e) {
  return (e < kE8m0MinExponent || e > kE8m0MaxExponent) ? kE8m0NaN
                                                        : static_cast<uint8_t>(e + kE8m0Bias);
}

// The code of x when x is a power of two in [2^-127, 2^127]; NaN (0xFF) for any other x (zero,
// negative, not a power of two, out of range, Inf, NaN): E8M0 has no rounding of its own in this
// library, since every scale is computed as an exponent.
MOK_FP8_HD constexpr uint8_t e8m0_encode(float x) {
  const uint32_t u = detail::bits(x);
  if (u == 0x00400000u) return 0;  // 2^-127
  const uint32_t field = u >> 23;  // sign and exponent
  if ((u & 0x007fffffu) != 0 || field == 0 || field >= 255) return kE8m0NaN;
  return static_cast<uint8_t>(field);  // = e + 127
}

// ---- Block maximum ------------------------------------------------------------------------------

// max(amax, |v|) with NaN winning over everything (fmaxf would drop it). On non-negative fp32
// bit patterns unsigned comparison is magnitude order, and every NaN pattern lies above +Inf.
MOK_FP8_HD constexpr float amax_update(float amax, float v) {
  const uint32_t a = detail::bits(amax) & detail::kAbsMask;
  const uint32_t b = detail::bits(v) & detail::kAbsMask;
  return detail::from_bits(a > b ? a : b);
}

MOK_FP8_HD constexpr bool is_finite(float v) {
  return (detail::bits(v) & detail::kAbsMask) < detail::kInfBits;
}

// ---- MXFP8 (OCP Microscaling Formats v1.0, E4M3 elements) --------------------------------------
//
// The MX conversion (the spec's section 6.3, its Algorithm 1, in our words): for a block of k = 32
// values V_i, the shared exponent is floor(log2(max_i |V_i|)) minus emax_elem, the exponent of the
// element format's largest normal (8 for E4M3); the scale is X = 2^shared_exp; each element is
// P_i = quantize(V_i / X) with round to nearest even, normal values beyond the element range
// clamped to its largest magnitude with their sign. Mapping the block maximum into the top binade
// [256, 512) means a maximum whose significand exceeds 1.75 is clamped to 448 X: up to 12.5% error
// on that element, accepted by the spec for the full use of the element's range.
//
// What the spec leaves to the implementation, decided here (notes/fp8.md has the reasoning):
//   * the exponent is clamped to E8M0's range [-127, 127] (only the low end can be reached from
//     fp32 with E4M3 elements: floor(log2) <= 127 gives at most 119);
//   * an all-zero block: log2(0) = -Inf, which the clamp makes the smallest scale 2^-127 (code 0),
//     as the reference implementation's tiny-epsilon does; its elements are signed zeros;
//   * a block holding a NaN or an Inf: scale NaN (0xFF). E4M3 has no Inf and the spec says a NaN
//     scale makes every element of its block NaN, so an Inf cannot be carried otherwise; every
//     element code is then 0x7F too, so a reader that ignores the scale sees NaN as well.

inline constexpr int kMxBlock = 32;

// The E8M0 code of the shared scale of a block whose max |V_i| (amax_update over the block) is
// `amax`.
MOK_FP8_HD constexpr uint8_t mxfp8_scale_code(float amax) {
  const uint32_t a = detail::bits(amax) & detail::kAbsMask;
  if (a >= detail::kInfBits) return kE8m0NaN;
  if (a == 0) return e8m0_from_exponent(kE8m0MinExponent);
  int shared = detail::binade(amax).exponent - kE4m3Emax;
  if (shared < kE8m0MinExponent) shared = kE8m0MinExponent;
  return e8m0_from_exponent(shared);
}

// 1 / X for a scale code: V_i / X is formed as V_i * 2^-shared_exp, exact whenever the result can
// round to anything but zero in E4M3 (a power-of-two factor only moves the exponent; the one
// inexact case, an fp32 subnormal result, lies far below E4M3's rounding threshold 2^-10).
MOK_FP8_HD constexpr float mxfp8_inv_scale(uint8_t scale_code) {
  if (scale_code == kE8m0NaN) return detail::from_bits(detail::kQuietNaNBits);
  return detail::pow2(kE8m0Bias - static_cast<int>(scale_code));
}

MOK_FP8_HD constexpr uint8_t mxfp8_encode(float v, uint8_t scale_code) {
  if (scale_code == kE8m0NaN) return kE4m3NaN;
  return e4m3_encode(v * mxfp8_inv_scale(scale_code));
}

// X * P_i, exact in fp32 for every element code and every scale an E4M3 block can get.
MOK_FP8_HD constexpr float mxfp8_decode(uint8_t q, uint8_t scale_code) {
  return e4m3_decode(q) * e8m0_decode(scale_code);
}

// ---- Block-scaled FP8, DeepSeek-V3 recipe ------------------------------------------------------
//
// One fp32 scale s per block (1x128 of activations, 128x128 of weights); q = e4m3(v * r) with
// r = 1 / s, one IEEE fp32 division per block (block_inverse; a kernel built with --use_fast_math
// or -prec-div=false would differ in r's last bit now and then, and so at E4M3 ties) and one fp32
// product per element: a division per element made FC1's FP8 epilogue several times longer than
// its conversion (measured, notes/fp8.md). For Pow2 scales r is exact, so q = e4m3(v / s);
// for Fp32 scales v * r is within an fp32 ulp of v / s. Dequantized v' = decode(q) * s (one fp32
// product, which is what a kernel promoting its accumulator applies). Two rules for s:
//   * Fp32: s = amax / 448 (fp32 division), so the block maximum maps to ±448 (to within the
//     rounding of s, which the saturation absorbs) and no element saturates by more than that;
//   * Pow2: s = the smallest power of two with amax <= 448 s, i.e. 2^ceil(log2(amax / 448))
//     computed exactly. v / s is then exact and never beyond 448; s is an E8M0-representable
//     scale, which is how MXFP8 can be re-blocked to 1x128 on Hopper. One exception at the top
//     of fp32: s is at most 2^119 (the MX exponent of FLT_MAX), because with 2^120 an element
//     above ~3.19e38 would round to 256 * 2^120 = 2^128, which is Inf in fp32; a block whose
//     amax exceeds 448 * 2^119 (~2.98e38) therefore saturates as an MX block does.
// Shared by both rules:
//   * amax = 0: s = 1 (every element is a signed zero and dequantizes to one);
//   * s never goes below 2^-126, the smallest normal fp32: for amax < 448 * 2^-126 (~6.6e-36) a
//     smaller s would lose its own precision or underflow to 0 (and v / 0 is Inf); those blocks
//     keep the elements' relative precision down to E4M3's subnormals instead;
//   * a NaN or an Inf in the block: s = NaN and every code 0x7F, as for MXFP8.

inline constexpr int kBlock = 128;
inline constexpr float kMinBlockScale = 0x1p-126f;
inline constexpr int kPow2MaxExponent = 127 - kE4m3Emax;

enum class ScaleRule : uint8_t { Fp32, Pow2 };

MOK_FP8_HD constexpr float block_scale(float amax, ScaleRule rule) {
  const uint32_t a = detail::bits(amax) & detail::kAbsMask;
  if (a >= detail::kInfBits) return detail::from_bits(detail::kQuietNaNBits);
  if (a == 0) return 1.0f;
  const float m = detail::from_bits(a);
  if (rule == ScaleRule::Fp32) {
    const float s = m / kE4m3Max;
    return s < kMinBlockScale ? kMinBlockScale : s;
  }
  // amax = sig * 2^(f - 23), 448 = 1.75 * 2^8: amax <= 448 * 2^e holds for e = f - 8 exactly
  // when the significand is at most 1.75 (sig <= 0xe00000), else one binade higher is needed.
  const detail::Binade b = detail::binade(m);
  int e = b.exponent - kE4m3Emax + (b.sig > 0x00e00000u ? 1 : 0);
  if (e < -126) e = -126;
  if (e > kPow2MaxExponent) e = kPow2MaxExponent;
  return detail::pow2(e);
}

// r = 1 / s, once per block. A NaN scale gives a NaN r, and v * NaN encodes as NaN: the codes of a
// non-finite block come out right without a test per element.
MOK_FP8_HD constexpr float block_inverse(float scale) {
  return is_finite(scale) ? 1.0f / scale : detail::from_bits(detail::kQuietNaNBits);
}

// The code of v in a block whose inverse scale is `inverse` (block_inverse).
MOK_FP8_HD constexpr uint8_t block_encode_inv(float v, float inverse) { return e4m3_encode(v * inverse); }

MOK_FP8_HD constexpr uint8_t block_encode(float v, float scale) { return block_encode_inv(v, block_inverse(scale)); }

MOK_FP8_HD constexpr float block_decode(uint8_t q, float scale) { return e4m3_decode(q) * scale; }

}  // namespace mok::fp8
