// mok — host-side bfloat16 storage type.
//
// Conversion float -> bf16 rounds to nearest, ties to even, exactly like the device intrinsic
// __float2bfloat16_rn; NaN stays NaN (quiet, sign kept). The CPU reference therefore rounds at
// the same points to the same values as the GPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace mok {

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
    const uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;  // round to nearest even; overflow rounds to inf as it should
    return static_cast<uint16_t>(u >> 16);
  }
  static float to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static bf16 from_bits(uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
};

static_assert(sizeof(bf16) == 2, "bf16 must be two bytes");

// Rounds a float to the nearest bf16 value and returns it as float (a "rounding point").
inline float round_bf16(float f) { return bf16::to_float(bf16::from_float(f)); }

}  // namespace mok
