// mok — FP8 quantization of host arrays: the CPU reference of the quantize/dequantize steps,
// built on the element rules of src/common/fp8_format.h (which the GPU kernels share).
//
// Every array is row-major and dense: element (r, c) of a rows x cols matrix is at r * cols + c.
// Blocks tile the matrix from (0, 0); a block cut by the matrix's edge is quantized as if the
// missing elements were zeros (they cannot change a block maximum), so any shape is accepted.
// Scales are one per block, row-major over the grid of blocks:
//   scales[(r / block.rows) * scale_cols(cols, block) + c / block.cols].
// (The GPU kernels may want them MN-major for TMA; that is a layout of the same values.)
#pragma once

#include <cstdint>

#include "common/fp8_format.h"
#include "mok/bf16.hpp"

namespace mok::fp8 {

struct BlockShape {
  int64_t rows;
  int64_t cols;
};
inline constexpr BlockShape kActivationBlock{1, kBlock};   // per token, per 128 channels
inline constexpr BlockShape kWeightBlock{kBlock, kBlock};  // 128 x 128 tiles
inline constexpr BlockShape kMxBlockShape{1, kMxBlock};    // MXFP8: 32 along the row

inline int64_t scale_rows(int64_t rows, BlockShape b) { return (rows + b.rows - 1) / b.rows; }
inline int64_t scale_cols(int64_t cols, BlockShape b) { return (cols + b.cols - 1) / b.cols; }
inline int64_t scale_count(int64_t rows, int64_t cols, BlockShape b) {
  return scale_rows(rows, b) * scale_cols(cols, b);
}

// ---- One block -------------------------------------------------------------------------------
// The building blocks of the array functions, for callers that hold one block: n contiguous
// values (a 1xN block, n > 0). They return the block's scale and write its n codes.

float quantize_block(const float* v, int64_t n, ScaleRule rule, uint8_t* q);
uint8_t quantize_mx_block(const float* v, int64_t n, uint8_t* q);  // n <= kMxBlock

// ---- Block-scaled FP8 (DeepSeek-V3 recipe): fp32 scales -----------------------------------------
// in[rows, cols] -> q[rows, cols] E4M3 codes and scales[scale_count(rows, cols, block)] (fp32).
// Throws mok::Error (InvalidArgument) for a negative size, a block with a side < 1, or a null
// pointer where elements exist.

void quantize_blocked(const float* in, int64_t rows, int64_t cols, BlockShape block, ScaleRule rule,
                      uint8_t* q, float* scales);
void quantize_blocked(const bf16* in, int64_t rows, int64_t cols, BlockShape block, ScaleRule rule,
                      uint8_t* q, float* scales);
// out[r, c] = decode(q[r, c]) * scale of its block.
void dequantize_blocked(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                        BlockShape block, float* out);

// The recipe's two shapes: activations per token and 128 channels, weights in 128 x 128 tiles.
inline void quantize_1x128(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                           ScaleRule rule = ScaleRule::Fp32) {
  quantize_blocked(x, rows, cols, kActivationBlock, rule, q, scales);
}
inline void quantize_1x128(const bf16* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                           ScaleRule rule = ScaleRule::Fp32) {
  quantize_blocked(x, rows, cols, kActivationBlock, rule, q, scales);
}
inline void quantize_128x128(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                             ScaleRule rule = ScaleRule::Fp32) {
  quantize_blocked(w, rows, cols, kWeightBlock, rule, q, scales);
}
inline void quantize_128x128(const bf16* w, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                             ScaleRule rule = ScaleRule::Fp32) {
  quantize_blocked(w, rows, cols, kWeightBlock, rule, q, scales);
}

// ---- MXFP8: E8M0 scales, blocks of 32 along each row ----------------------------------------
// in[rows, cols] -> q[rows, cols] E4M3 codes and scales[rows, scale_cols(cols, kMxBlockShape)]
// E8M0 codes. Same argument checks as above.

void quantize_mxfp8(const float* in, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scales);
void quantize_mxfp8(const bf16* in, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scales);
void dequantize_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols,
                      float* out);

// ---- MXFP8 re-blocked (the way to run MX operands on Hopper's FP8 tensor cores) ------------------
// An MX matrix (q, scales as quantize_mxfp8 writes them) as block-scaled FP8 with one power-of-
// two fp32 scale per `block` (1 x 128 for activations, 128 x 128 for weights: what the recipe-1
// GEMMs read; dequantize_blocked reads the result): the block's scale is the largest E8M0 scale
// of the MX blocks inside it, 2^e_max, and each element is re-encoded at it,
// q' = e4m3(decode(q) * 2^(e - e_max)) (round to nearest even). Only the exponent moves, so the
// value is exact unless it falls below E4M3's normal range (2^-6 of the block's scale, 14 binades
// under its top): the elements that change are the smallest ones. A block with a NaN MX scale is
// NaN (scale NaN, every code 0x7F), as a block-scaled block with a NaN element is. A block of zeros
// (or of magnitudes below 2^-118) gets 2^-127, E8M0's smallest scale: an fp32 subnormal, unlike
// the recipe's own scales (1 for a zero block, never below 2^-126) — the GEMMs multiply scales
// without flushing subnormals, so it decodes the same. block.cols must be a multiple of 32. The GEMMs then promote once per 128 of K instead of once per 32; what the
// second rounding costs is measured in tests/cpu/test_fp8_error_budget.cpp (notes/fp8.md).
void reblock_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols, BlockShape block,
                   uint8_t* q_out, float* scales_out);

}  // namespace mok::fp8
