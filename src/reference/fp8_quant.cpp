// FP8 quantization of host arrays (see fp8_quant.h). Plain loops over the element rules of
// common/fp8_format.h: a block's maximum first, then its scale, then its codes, so that the
// results are those of the rules and nothing else (no threads, no reordering that could matter:
// a maximum does not depend on the order it is taken in).
#include "reference/fp8_quant.h"

#include <algorithm>

#include "mok/errors.hpp"

namespace mok::fp8 {
namespace {

inline float load(const float* p) { return *p; }
inline float load(const bf16* p) { return static_cast<float>(*p); }  // exact widening

void check_shape(int64_t rows, int64_t cols, BlockShape block) {
  MOK_REQUIRE(rows >= 0, "rows", "rows >= 0 (rows = ", rows, ")");
  MOK_REQUIRE(cols >= 0, "cols", "cols >= 0 (cols = ", cols, ")");
  MOK_REQUIRE(block.rows >= 1 && block.cols >= 1, "block",
              "both block sides >= 1 (block = ", block.rows, " x ", block.cols, ")");
}

void check_pointer(const void* p, const char* name, int64_t rows, int64_t cols) {
  MOK_REQUIRE(p != nullptr || rows == 0 || cols == 0, name, "not null when rows * cols > 0");
}

// Calls fn(r0, r1, c0, c1, index) for every block, index being its place in the scale grid.
template <typename Fn>
void for_each_block(int64_t rows, int64_t cols, BlockShape block, Fn&& fn) {
  const int64_t grid_cols = scale_cols(cols, block);
  for (int64_t br = 0; br < scale_rows(rows, block); ++br) {
    const int64_t r0 = br * block.rows;
    const int64_t r1 = std::min(rows, r0 + block.rows);
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      const int64_t c0 = bc * block.cols;
      const int64_t c1 = std::min(cols, c0 + block.cols);
      fn(r0, r1, c0, c1, br * grid_cols + bc);
    }
  }
}

template <typename T>
void quantize_blocked_impl(const T* in, int64_t rows, int64_t cols, BlockShape block,
                           ScaleRule rule, uint8_t* q, float* scales) {
  check_shape(rows, cols, block);
  check_pointer(in, "in", rows, cols);
  check_pointer(q, "q", rows, cols);
  check_pointer(scales, "scales", rows, cols);
  for_each_block(rows, cols, block, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t i) {
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = amax_update(amax, load(in + r * cols + c));
    const float s = block_scale(amax, rule);
    scales[i] = s;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = block_encode(load(in + r * cols + c), s);
  });
}

template <typename T>
void quantize_mxfp8_impl(const T* in, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scales) {
  check_shape(rows, cols, kMxBlockShape);
  check_pointer(in, "in", rows, cols);
  check_pointer(q, "q", rows, cols);
  check_pointer(scales, "scales", rows, cols);
  for_each_block(rows, cols, kMxBlockShape,
                 [&](int64_t r, int64_t, int64_t c0, int64_t c1, int64_t i) {
                   const T* v = in + r * cols;
                   float amax = 0.0f;
                   for (int64_t c = c0; c < c1; ++c) amax = amax_update(amax, load(v + c));
                   const uint8_t x = mxfp8_scale_code(amax);
                   scales[i] = x;
                   for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = mxfp8_encode(load(v + c), x);
                 });
}

}  // namespace

float quantize_block(const float* v, int64_t n, ScaleRule rule, uint8_t* q) {
  MOK_REQUIRE(n >= 1, "n", "n >= 1 (n = ", n, ")");
  float s = 0.0f;
  quantize_blocked_impl(v, 1, n, BlockShape{1, std::max<int64_t>(n, 1)}, rule, q, &s);
  return s;
}

uint8_t quantize_mx_block(const float* v, int64_t n, uint8_t* q) {
  MOK_REQUIRE(n >= 1 && n <= kMxBlock, "n", "1 <= n <= ", kMxBlock, " (n = ", n, ")");
  uint8_t x = 0;
  quantize_mxfp8_impl(v, 1, n, q, &x);
  return x;
}

void quantize_blocked(const float* in, int64_t rows, int64_t cols, BlockShape block, ScaleRule rule,
                      uint8_t* q, float* scales) {
  quantize_blocked_impl(in, rows, cols, block, rule, q, scales);
}
void quantize_blocked(const bf16* in, int64_t rows, int64_t cols, BlockShape block, ScaleRule rule,
                      uint8_t* q, float* scales) {
  quantize_blocked_impl(in, rows, cols, block, rule, q, scales);
}

void dequantize_blocked(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                        BlockShape block, float* out) {
  check_shape(rows, cols, block);
  check_pointer(q, "q", rows, cols);
  check_pointer(scales, "scales", rows, cols);
  check_pointer(out, "out", rows, cols);
  for_each_block(rows, cols, block, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t i) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c)
        out[r * cols + c] = block_decode(q[r * cols + c], scales[i]);
  });
}

void quantize_mxfp8(const float* in, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scales) {
  quantize_mxfp8_impl(in, rows, cols, q, scales);
}
void quantize_mxfp8(const bf16* in, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scales) {
  quantize_mxfp8_impl(in, rows, cols, q, scales);
}

void dequantize_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols,
                      float* out) {
  check_shape(rows, cols, kMxBlockShape);
  check_pointer(q, "q", rows, cols);
  check_pointer(scales, "scales", rows, cols);
  check_pointer(out, "out", rows, cols);
  for_each_block(rows, cols, kMxBlockShape,
                 [&](int64_t r, int64_t, int64_t c0, int64_t c1, int64_t i) {
                   for (int64_t c = c0; c < c1; ++c)
                     out[r * cols + c] = mxfp8_decode(q[r * cols + c], scales[i]);
                 });
}

void reblock_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols, BlockShape block,
                   uint8_t* q_out, float* scales_out) {
  check_shape(rows, cols, block);
  MOK_REQUIRE(block.cols % kMxBlock == 0, "block", "whole MX blocks along the row (cols a multiple of ", kMxBlock,
              ", got ", block.cols, ")");
  check_pointer(q, "q", rows, cols);
  check_pointer(scales, "scales", rows, cols);
  check_pointer(q_out, "q_out", rows, cols);
  check_pointer(scales_out, "scales_out", rows, cols);
  const int64_t mx_cols = scale_cols(cols, kMxBlockShape);
  const auto mx_scale = [&](int64_t r, int64_t c) { return scales[r * mx_cols + c / kMxBlock]; };
  for_each_block(rows, cols, block, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t i) {
    bool nan = false;
    int e_max = kE8m0MinExponent;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; c += kMxBlock) {
        const uint8_t x = mx_scale(r, c);
        if (x == kE8m0NaN) nan = true;
        else e_max = std::max(e_max, int(x) - kE8m0Bias);
      }
    if (nan) {
      scales_out[i] = detail::from_bits(detail::kQuietNaNBits);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q_out[r * cols + c] = kE4m3NaN;
      return;
    }
    scales_out[i] = e8m0_decode(e8m0_from_exponent(e_max));  // 2^e_max, exact in fp32
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const int d = int(mx_scale(r, c)) - kE8m0Bias - e_max;
        // decode(q) * 2^d: a power-of-two factor <= 1, exact in fp32 down to its subnormals (far
        // below E4M3's smallest subnormal, 2^-9; below 2^-149 the factor is 0 and the code a signed
        // zero), then E4M3's round to nearest even.
        const float f = d >= -149 ? detail::pow2(d) : 0.0f;
        q_out[r * cols + c] = e4m3_encode(e4m3_decode(q[r * cols + c]) * f);
      }
  });
}

}  // namespace mok::fp8
