// mok — the FP8 weight gradients' token blocks (see fp8_quantize.h): 128 x 1 blocks along the
// rows (tokens), codes written transposed (K-major) over the routed segments; alone, with the rows'
// 1 x 128 codes from the same read (quantize_fp8_rows_and_token_blocks_t), read where each row
// lives (quantize_fp8_token_blocks_t_gather, the backward's x), and MXFP8's re-blocked form.
#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/fp8_cvt.cuh"
#include "gemm/fp8_quantize.h"
#include "gemm/fp8_quantize_common.cuh"
#include "mok/errors.hpp"

namespace mok::gemm {
namespace {
using namespace quant;

// 128 x 1 blocks of a 128-row x 128-column tile, one CTA of 256 threads each, codes out
// transposed. Thread t holds columns 2 (t % 64) and 2 (t % 64) + 1 of the tile's 32 rows from
// 32 (t / 64): a warp's load of one row is 128 contiguous bytes (pairs of bf16, kPairs: cols even
// and `in` 4-byte aligned; else two 2-byte loads), each thread's 32 loads are independent, the four
// row groups of a column combine their maxima through shared memory, and a thread's 32 codes of
// a column are 32 consecutive bytes of q_t, stored from registers (two 16-byte stores when q_t is
// 16-byte aligned, `vec_store`; ld is a multiple of 128, so every column's run is then aligned).
// kRowForm: the same tile also gives the rows' 1 x 128 codes (quantize_fp8_blocked's, block_rows
// 1): a warp's 32 threads hold 64 columns of 32 rows, so one warp reduction per row (REDUX, an
// unsigned maximum of the magnitudes' bits: amax_update's order-free maximum) gives row l's
// maximum over the warp's columns to lane l; the tile's two warps of a row group join theirs in
// shared memory; the codes go out by rows through shared memory as 16-byte runs. Then every row
// of the matrix is read (the row form quantizes padding rows as they are, the token form masks
// them). `g.peers`: the rows are read where they live (RowGather).
//
// One column's 32 codes of a token block as 8 words, at dst. Rows past the data (`valid`) are
// zero codes whatever the scale (a block holding a NaN or an infinity has a NaN scale, and 0 * its
// inverse would encode as NaN: the FP8 wgrad multiplies every row), so the value is selected before
// the multiplication. (A function, not a lambda: the lambda taking the array was not inlined in the
// row-form kernel, which put the array in local memory.)
// kMx (MXFP8 re-blocked to 128 x 1, the column's 32 rows being one MX block): the value is the MX
// code (E8M0 scale `sc`) decoded and moved to the block's scale 2^top (factor `f`), as
// quantize_mxfp8_reblocked's; a NaN block (top 0xff) gives NaN codes for its rows of data.
template <bool kMx = false>
__device__ __forceinline__ void store_token_column(const float (&v)[32], float inv, int valid, uint8_t* dst,
                                                   bool vec_store, uint8_t sc = 0, uint32_t top = 0) {
  [[maybe_unused]] float f = 0.0f;
  if constexpr (kMx) {
    f = mx_shift(sc, top);
    inv = fp8::mxfp8_inv_scale(sc);
  }
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = 4 * j + k < valid ? v[4 * j + k] * (kMx ? 1.0f : inv) : 0.0f;
    if constexpr (kMx) {
      if (top == fp8::kE8m0NaN) {  // (its inverse scale is NaN: the rows of data get NaN codes)
        w[j] = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) w[j] |= 4 * j + k < valid ? uint32_t(fp8::kE4m3NaN) << (8 * k) : 0u;
      } else {
        w[j] = uint32_t(mx_reblocked2(x[0], x[1], inv, f)) | (uint32_t(mx_reblocked2(x[2], x[3], inv, f)) << 16);
      }
    } else {
      w[j] = uint32_t(e4m3x2(x[0], x[1])) | (uint32_t(e4m3x2(x[2], x[3])) << 16);
    }
  }
  if (vec_store) {
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) dst[j] = uint8_t(w[j / 4] >> (8 * (j % 4)));
  }
}

struct RowForm {
  uint8_t* q = nullptr;  // [rows, cols] codes; nullptr: no row form
  float* scales = nullptr;
  fp8::ScaleRule rule = fp8::ScaleRule::Fp32;
  bool vec = false;  // cols a multiple of 16 and q 16-byte aligned: 16-byte stores
};
template <bool kPairs, bool kRowForm, bool kGather, bool kMx = false>
// (MX pairs: 3 CTAs per SM, 85 registers: its conversions spilled at 4.)
__global__ void __launch_bounds__(kTileThreads, kPairs && !kRowForm ? (kMx ? 3 : 4) : 1)
    quantize_token_blocks_t_kernel(const uint16_t* in, int64_t rows, int64_t cols, int64_t ld, uint8_t* q_t,
                                   float* scales, RoutedSegments seg, bool vec_store, RowForm rf, RowGather g) {
  constexpr int kB = fp8::kBlock, kGroups = kTileThreads / (kB / 2), kRows = kB / kGroups;  // 4 groups of 32 rows
  static_assert(kRows == 32, "a thread's codes of one column: 32 bytes");
  __shared__ float col_max[kGroups][kB];
  __shared__ float row_part[kRowForm ? kGroups : 1][2][kRows];
  __shared__ float row_inv[kRowForm ? kGroups : 1][kRows];
  __shared__ __align__(16) uint16_t row_codes[kRowForm ? kB : 1][kB / 2];  // the tile's 1 x 128 codes, by pairs
  __shared__ const uint16_t* row_src[kGather ? kB : 1];  // RowGather: each row's address (nullptr: zeros)
  const int64_t grid_cols = (cols + kB - 1) / kB;
  const int64_t br = blockIdx.x / grid_cols, bc = blockIdx.x - br * grid_cols;
  const int pair = int(threadIdx.x % (kB / 2)), group = int(threadIdx.x / (kB / 2));
  const int lane = int(threadIdx.x % 32u);
  const int64_t c = bc * kB + 2 * pair;       // the thread's first column
  const int64_t r0 = br * kB + group * kRows;  // its first row
  // The block's rows that hold data: all up to `rows`, or (segments) those of its tile's expert.
  int64_t row_end = rows;
  if (seg.tile_expert != nullptr) {
    const int32_t e = br < seg.num_m_tiles ? __ldg(seg.tile_expert + br) : -1;
    // A tile of no expert (the layout past the routed rows) is read by no GEMM: nothing to write
    // (at EP 8 the worst-case layout is ~8x the routed rows; over windows most windows are empty).
    if (e < 0) return;
    row_end = min(rows, int64_t(__ldg(seg.expert_row_begin + e)) + __ldg(seg.expert_rows + e));
  }
  const int valid = int(max(int64_t(0), min(int64_t(kRows), row_end - r0)));  // the thread's rows of data
  const int loaded = kRowForm ? int(max(int64_t(0), min(int64_t(kRows), rows - r0))) : valid;  // rows read
  static_assert(!kGather || (kPairs && !kRowForm), "RowGather: pairs, no row form");
  static_assert(!kMx || !kRowForm, "MXFP8 token blocks: no row form (the rows take quantize_mxfp8_reblocked)");
  if constexpr (kGather) {  // the tile's row addresses, once (not 32 index loads per thread)
    const bool aborted = g.abort != nullptr && *reinterpret_cast<const volatile uint32_t*>(g.abort) != 0u;
    if (threadIdx.x < kB) {
      const int64_t r = br * kB + threadIdx.x;
      const int src = r < row_end && !aborted ? __ldg(g.src_rank + r) : -1;
      row_src[threadIdx.x] =
          src >= 0 ? static_cast<const uint16_t*>(g.peers[src]) + int64_t(__ldg(g.src_slot + r) / g.top_k) * cols
                   : nullptr;
    }
    __syncthreads();
  }
  const bool has0 = c < cols, has1 = c + 1 < cols;
  float lo[kRows], hi[kRows];  // columns c and c + 1; past the data or the edge: zeros
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const uint16_t* p = in + (r0 + i) * cols + c;
    bool load = i < loaded && has0;
    if constexpr (kGather) {
      const uint16_t* row = row_src[group * kRows + i];
      load = load && row != nullptr;
      p = row + c;
    }
    if constexpr (kPairs) {  // (cols even: has0 implies has1)
      const uint32_t w = load ? __ldg(reinterpret_cast<const uint32_t*>(p)) : 0u;
      lo[i] = __uint_as_float(w << 16);
      hi[i] = __uint_as_float(w & 0xffff0000u);
    } else {
      lo[i] = load ? bf16_at(p) : 0.0f;
      hi[i] = i < loaded && has1 ? bf16_at(p + 1) : 0.0f;
    }
  }
  float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if (!kRowForm || i < valid) {  // (without the row form the rows past the data are zeros already)
      a0 = fp8::amax_update(a0, lo[i]);
      a1 = fp8::amax_update(a1, hi[i]);
    }
  }
  // kMx: the thread's 32 rows of a column are one MX block: its E8M0 code goes into col_max in
  // place of the maximum (as float bits: amax_update's unsigned maximum of the bits is then the
  // largest code of the column's four, the re-blocked scale's exponent; NaN, 0xff, wins).
  [[maybe_unused]] uint8_t sc0 = 0, sc1 = 0;
  if constexpr (kMx) {
    sc0 = fp8::mxfp8_scale_code(a0);
    sc1 = fp8::mxfp8_scale_code(a1);
    a0 = __uint_as_float(sc0);
    a1 = __uint_as_float(sc1);
  }
  col_max[group][2 * pair] = a0;
  col_max[group][2 * pair + 1] = a1;
  if constexpr (kRowForm) {  // row i's maximum over the warp's 64 columns: one REDUX (unsigned max) each
    float mine = 0.0f;  // lane l keeps row l's
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const uint32_t m = __reduce_max_sync(0xffffffffu, __float_as_uint(fp8::amax_update(lo[i], hi[i])));
      if (lane == i) mine = __uint_as_float(m);
    }
    row_part[group][pair / 32][lane] = mine;  // row r0 + lane, this warp's 64 columns
  }
  __syncthreads();
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {  // (amax_update is order-free: the same maximum as the spec's)
    a0 = fp8::amax_update(a0, col_max[gi][2 * pair]);
    a1 = fp8::amax_update(a1, col_max[gi][2 * pair + 1]);
  }
  if constexpr (kRowForm) {
    if (pair < 32) {  // the group's first warp: lane l takes row r0 + l
      const float s = fp8::block_scale(fp8::amax_update(row_part[group][0][lane], row_part[group][1][lane]), rf.rule);
      row_inv[group][lane] = fp8::block_inverse(s);
      if (lane < loaded) rf.scales[(r0 + lane) * grid_cols + bc] = s;
    }
  }
  float s0, s1, inv0 = 0.0f, inv1 = 0.0f;
  if constexpr (kMx) {  // 2^top, or NaN
    s0 = fp8::e8m0_decode(uint8_t(__float_as_uint(a0)));
    s1 = fp8::e8m0_decode(uint8_t(__float_as_uint(a1)));
  } else {
    s0 = fp8::block_scale(a0, fp8::ScaleRule::Fp32), inv0 = fp8::block_inverse(s0);
    s1 = fp8::block_scale(a1, fp8::ScaleRule::Fp32), inv1 = fp8::block_inverse(s1);
  }
  if (group == 0) {
    if (has0) scales[br * cols + c] = s0;
    if (has1) scales[br * cols + c + 1] = s1;
  }
  // One column's 32 codes as 8 words. Rows past the data are zero codes whatever the scale (a
  // block holding a NaN or an infinity has a NaN scale, and 0 * its inverse would encode as NaN:
  // the FP8 wgrad multiplies every row), so the value is selected before the multiplication.
  if (has0)
    store_token_column<kMx>(lo, inv0, valid, q_t + c * ld + r0, vec_store, sc0, __float_as_uint(a0));
  if (has1)
    store_token_column<kMx>(hi, inv1, valid, q_t + (c + 1) * ld + r0, vec_store, sc1, __float_as_uint(a1));
  if constexpr (kRowForm) {  // (kPairs: cols even, so has0 means both columns; q 2-byte aligned)
    __syncthreads();  // row_inv
#pragma unroll
    for (int i = 0; i < kRows; ++i) row_codes[group * kRows + i][pair] = block_encode_inv2(lo[i], hi[i], row_inv[group][i]);
    __syncthreads();
    // Out by rows: 8 threads per row, 16 bytes each (rf.vec: cols a multiple of 16, q 16-byte
    // aligned: a row's chunks are whole), else the 2-byte pairs.
    const int64_t width = min(int64_t(kB), cols - bc * kB);  // the tile's columns
    if (rf.vec) {
#pragma unroll
      for (int pass = 0; pass < kB / (kTileThreads / 8); ++pass) {
        const int row = pass * (kTileThreads / 8) + int(threadIdx.x / 8), chunk = int(threadIdx.x % 8);
        if (br * kB + row < rows && chunk * 16 < width)
          *reinterpret_cast<uint4*>(rf.q + (br * kB + row) * cols + bc * kB + chunk * 16) =
              *reinterpret_cast<const uint4*>(&row_codes[row][chunk * 8]);
      }
    } else if (has0) {
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        if (i < loaded) *reinterpret_cast<uint16_t*>(rf.q + (r0 + i) * cols + c) = row_codes[group * kRows + i][pair];
    }
  }
}

void check_segments(const RoutedSegments& seg) {
  MOK_REQUIRE(seg.tile_expert == nullptr || (seg.expert_row_begin != nullptr && seg.expert_rows != nullptr), "seg",
              "expert_row_begin and expert_rows must be given with tile_expert");
  MOK_REQUIRE(seg.num_m_tiles >= 0, "seg.num_m_tiles", ">= 0, got ", seg.num_m_tiles);
}
// One launch of the token-block kernel (the checks done by the caller).
template <bool kPairs, bool kRowForm, bool kGather = false, bool kMx = false>
void launch_token_blocks(const uint16_t* in, int64_t rows, int64_t cols, void* q_t, float* scales,
                         const RoutedSegments& seg, const RowForm& rf, const RowGather& g, cudaStream_t stream) {
  const int64_t ld = (rows + fp8::kBlock - 1) / fp8::kBlock * fp8::kBlock;
  const int64_t tiles = ld / fp8::kBlock * ((cols + fp8::kBlock - 1) / fp8::kBlock);
  MOK_REQUIRE(tiles < (int64_t(1) << 31), "rows, cols", "fewer than 2^31 tiles of 128 x 128, got ", tiles);
  auto* out = static_cast<uint8_t*>(q_t);
  quantize_token_blocks_t_kernel<kPairs, kRowForm, kGather, kMx><<<static_cast<unsigned>(tiles), kTileThreads, 0,
                                                                    stream>>>(
      in, rows, cols, ld, out, scales, seg, aligned(out, 16), rf, g);
  MOK_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void quantize_fp8_token_blocks_t(const void* in_bf16, int64_t rows, int64_t cols, void* q_t, float* scales,
                                 cudaStream_t stream, const RoutedSegments& seg, bool mx) {
  check_args(in_bf16, rows, cols, q_t, scales);
  check_segments(seg);
  if (rows == 0 || cols == 0) return;
  const auto* in = static_cast<const uint16_t*>(in_bf16);
  const bool pairs = cols % 2 == 0 && aligned(in, 4);
  if (pairs && mx)
    launch_token_blocks<true, false, false, true>(in, rows, cols, q_t, scales, seg, {}, {}, stream);
  else if (pairs)
    launch_token_blocks<true, false>(in, rows, cols, q_t, scales, seg, {}, {}, stream);
  else if (mx)
    launch_token_blocks<false, false, false, true>(in, rows, cols, q_t, scales, seg, {}, {}, stream);
  else
    launch_token_blocks<false, false>(in, rows, cols, q_t, scales, seg, {}, {}, stream);
}

void quantize_fp8_token_blocks_t_gather(const RowGather& g, int64_t rows, int64_t cols, void* q_t, float* scales,
                                        cudaStream_t stream, const RoutedSegments& seg, bool mx) {
  check_segments(seg);
  MOK_REQUIRE(rows >= 0 && cols >= 0, "rows, cols", ">= 0, got ", rows, " x ", cols);
  if (rows == 0 || cols == 0) return;
  MOK_REQUIRE(g.peers != nullptr && g.src_rank != nullptr && g.src_slot != nullptr, "g",
              "peers, src_rank and src_slot must be given");
  MOK_REQUIRE(g.top_k >= 1, "g.top_k", ">= 1, got ", g.top_k);
  MOK_REQUIRE(seg.tile_expert != nullptr, "seg", "a gathered matrix needs its routed segments (its valid rows)");
  MOK_REQUIRE(cols % 2 == 0, "cols", "even for a gathered matrix (bf16 pairs; each peer's rows 4-byte aligned), got ",
              cols);
  MOK_REQUIRE(q_t != nullptr && scales != nullptr, "q_t, scales", "not null when rows * cols > 0");
  if (mx)
    launch_token_blocks<true, false, true, true>(nullptr, rows, cols, q_t, scales, seg, {}, g, stream);
  else
    launch_token_blocks<true, false, true>(nullptr, rows, cols, q_t, scales, seg, {}, g, stream);
}

void quantize_fp8_rows_and_token_blocks_t(const void* in_bf16, int64_t rows, int64_t cols, fp8::ScaleRule rule,
                                          void* q, float* q_scales, void* q_t, float* t_scales, cudaStream_t stream,
                                          const RoutedSegments& seg, bool mx) {
  check_args(in_bf16, rows, cols, q, q_scales);
  check_args(in_bf16, rows, cols, q_t, t_scales);
  check_segments(seg);
  if (rows == 0 || cols == 0) return;
  if (mx) {  // two passes (the one-pass row form is recipe 1's only)
    quantize_mxfp8_reblocked(in_bf16, rows, cols, 1, q, q_scales, stream);
    quantize_fp8_token_blocks_t(in_bf16, rows, cols, q_t, t_scales, stream, seg, true);
    return;
  }
  const auto* in = static_cast<const uint16_t*>(in_bf16);
  if (cols % 2 != 0 || !aligned(in, 4) || !aligned(q, 2)) {  // the two passes give the same bits
    quantize_fp8_blocked(in_bf16, rows, cols, 1, rule, q, q_scales, stream);
    quantize_fp8_token_blocks_t(in_bf16, rows, cols, q_t, t_scales, stream, seg);
    return;
  }
  launch_token_blocks<true, true>(in, rows, cols, q_t, t_scales, seg,
                                  RowForm{static_cast<uint8_t*>(q), q_scales, rule, cols % 16 == 0 && aligned(q, 16)},
                                  {}, stream);
}

}  // namespace mok::gemm
