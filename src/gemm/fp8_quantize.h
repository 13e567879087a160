// mok — FP8 quantization on the GPU: the device twins of the CPU spec in src/reference/fp8_quant.h,
// built on the same element rules (src/common/fp8_format.h), so the codes and scales are the same
// bits (tests/gpu/gemm/test_fp8_quantize.cu checks every one). bf16 matrices in, row-major and
// dense; E4M3 codes out in the same layout, and one scale per block, row-major over the grid of
// blocks, as the spec lays them (scales[(r / block rows) * scale columns + c / block columns]); a
// block cut by the matrix's edge is quantized as if the missing elements were zeros.
//
// These are the standalone forms of the FP8 recipes (issue 22): the layer will quantize where the
// data is made (x at its source before the pull, h in FC1's epilogue, d_out before the reverse
// combine), with these same per-block steps; standalone they quantize weights (128 x 128) and are
// the GPU side of the format tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_format.h"

namespace mok::gemm {

// Block-scaled E4M3 with fp32 scales: blocks of block_rows x 128 (1: activations per token and
// 128 channels; 128: weights in 128 x 128 tiles). q: rows x cols bytes; scales:
// ceil(rows / block_rows) x ceil(cols / 128) floats. Throws mok::Error naming the argument for a
// negative size, a block_rows other than 1 or 128, or a null pointer where elements exist.
void quantize_fp8_blocked(const void* in_bf16, int64_t rows, int64_t cols, int block_rows, fp8::ScaleRule rule,
                          void* q, float* scales, cudaStream_t stream);

// The FP8 backward's weight-gradient operands (recipe 1, include/mok/reference.hpp): K is the
// rows (tokens), so blocks of 128 x 1 — 128 consecutive rows of one column, i.e. one 128-row M
// tile — with fp32 scales, and the codes written transposed, K-major as FP8 wgmma reads them:
// q_t[c * ld + r] for ld = rows rounded up to 128 (the last tile's missing rows get code 0, a
// zero); scales[(r / 128) * cols + c] (the spec's row-major grid of blocks). q_t: cols x ld bytes;
// scales: ceil(rows / 128) x cols floats. Same checks as above.
// With `seg` (the routed layout of the rows: 128-row tiles, each of one expert, whose segment
// begins on a tile), only the rows inside their expert's segment are data: the padding rows after
// a segment's last valid row quantize as zeros (as the spec's blocks, which hold the expert's rows
// only; the FP8 wgrad reads them unmasked), and a tile whose tile_expert is -1 (or past
// num_m_tiles) is not written at all, in either form (no GEMM reads it).
struct RoutedSegments {
  const int32_t* tile_expert = nullptr;       // device [num_m_tiles]; nullptr: every row is data
  const int32_t* expert_row_begin = nullptr;  // device [experts]
  const int32_t* expert_rows = nullptr;       // device [experts]
  int64_t num_m_tiles = 0;
};
// mx: MXFP8 re-blocked (Config::precision MXFP8's backward): each column's 32-row runs are MX
// blocks (an E8M0 scale each, 32 | 128 so none straddles a tile), re-encoded at the largest of the
// 128 x 1 block's four, whose scale 2^e (or NaN) is stored: quantize_mxfp8_reblocked's rule along
// the tokens. Rows past the data are zero codes as above.
void quantize_fp8_token_blocks_t(const void* in_bf16, int64_t rows, int64_t cols, void* q_t, float* scales,
                                 cudaStream_t stream, const RoutedSegments& seg = {}, bool mx = false);

// The same token blocks of a routed matrix that is not there: row r is read where it lives,
// rank src_rank[r]'s row src_slot[r] / top_k of peers[src_rank[r]] (bf16 [T, cols], a peer's
// address for another rank) — the rows pull_dispatch would copy first, so the backward needs no
// routed bf16 copy of x. seg is required (its valid rows are the ones read); src_rank < 0 reads
// zeros. Once *abort is nonzero no peer is read (zeros; results after an abort are undefined, as
// every call's then). cols even.
struct RowGather {
  const void* const* peers = nullptr;  // device [W]
  const int32_t* src_rank = nullptr;   // device [rows]
  const int32_t* src_slot = nullptr;   // device [rows]: token * top_k + slot
  int64_t top_k = 1;
  const uint32_t* abort = nullptr;     // may be null
};
void quantize_fp8_token_blocks_t_gather(const RowGather& g, int64_t rows, int64_t cols, void* q_t, float* scales,
                                        cudaStream_t stream, const RoutedSegments& seg, bool mx = false);

// Both forms of one matrix from one read of it: quantize_fp8_blocked(in, rows, cols, 1, rule, q,
// q_scales) and quantize_fp8_token_blocks_t(in, rows, cols, q_t, t_scales, stream, seg), the
// same bits (the FP8 backward's d_y and d_gu: 1 x 128 for the dgrads, 128 x 1 for the wgrads).
// An odd cols or unaligned buffers take the two passes. mx: both forms MXFP8 re-blocked
// (quantize_mxfp8_reblocked's rows, the token blocks' mx form; two passes, `rule` unused).
void quantize_fp8_rows_and_token_blocks_t(const void* in_bf16, int64_t rows, int64_t cols, fp8::ScaleRule rule,
                                          void* q, float* q_scales, void* q_t, float* t_scales, cudaStream_t stream,
                                          const RoutedSegments& seg = {}, bool mx = false);

// The FP8 dgrads' weights (recipe 1): FP8 wgmma reads B K-major, so a dgrad needs each expert's
// weight transposed: out[e] = w[e]^T, [experts, cols, rows] from [experts, rows, cols] bf16 (FC2's
// dgrad: W_down^T [E, inter, hidden]); quantize_fp8_blocked(out, experts * cols, rows, 128) then
// gives the forward's 128 x 128 codes and scales transposed (a block's amax does not depend on the
// orientation). With w_up (FC1's dgrad: w = W_gate, w_up = W_up, each [E, inter, hidden]) the
// output's K is the packed gate/up order of mok/gemm.hpp: out[e][c][k] = (gate or up)[e][i(k)][c],
// [experts, hidden, 2 * inter], so its 128 x 128 blocks hold 64 gate and 64 up rows of the same
// intermediate columns — the blocks of d_gu's 1 x 128 quantization in that order. rows and cols
// multiples of 32 (with w_up: inter a multiple of 32 — the packed groups).
void transpose_weights_bf16(const void* w, const void* w_up, int64_t experts, int64_t rows, int64_t cols, void* out,
                            cudaStream_t stream);

// The same codes and scales as transpose_weights_bf16 followed by quantize_fp8_blocked(out,
// experts * cols, K, 128, rule) — bit for bit — in one pass over the bf16 weights, with no
// transposed bf16 copy: q_t [experts, cols, K] E4M3 (K = rows, or 2 * rows in the packed order
// with w_up), scales [experts * cols / 128, K / 128]. cols and K multiples of 128 (so no output
// block spans two experts), w, w_up and q_t 16-byte aligned; named errors otherwise. mx: MXFP8
// re-blocked instead (`rule` unused): the same bits as transpose_weights_bf16 followed by
// quantize_mxfp8_reblocked(out, experts * cols, K, 128) — MX blocks of 32 along the output's K.
void quantize_fp8_weights_t(const void* w, const void* w_up, int64_t experts, int64_t rows, int64_t cols,
                            fp8::ScaleRule rule, void* q_t, float* scales, cudaStream_t stream, bool mx = false);

// MXFP8 (E4M3 elements, an E8M0 scale per 32 along each row): q rows x cols bytes, scales
// rows x ceil(cols / 32) E8M0 codes. Same checks.
void quantize_mxfp8(const void* in_bf16, int64_t rows, int64_t cols, void* q, uint8_t* scales, cudaStream_t stream);

// MXFP8 re-blocked to power-of-two scales per block_rows x 128 block (1: activations, 128: the
// weights' 128 x 128) in one pass: the same bits as quantize_mxfp8 followed by
// fp8::reblock_mxfp8(..., {block_rows, 128}, ...) (the CPU spec): codes rows x cols, scales
// ceil(rows / block_rows) x ceil(cols / 128) floats (2^e, or NaN), the layout quantize_fp8_blocked
// writes, so MXFP8 operands feed the recipe-1 FP8 GEMMs (notes/fp8.md, "MXFP8 on Hopper"). Same
// checks (GPU test: Fp8Quantize.MxReblockedMatchesTheSpec).
void quantize_mxfp8_reblocked(const void* in_bf16, int64_t rows, int64_t cols, int block_rows, void* q,
                              float* scales, cudaStream_t stream);

}  // namespace mok::gemm
