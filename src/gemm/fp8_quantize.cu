// mok — FP8 quantization kernels (see fp8_quantize.h). Row blocks (1 x 128, MXFP8's 1 x 32): one
// warp per block, each lane holding consecutive elements, several blocks per warp in flight;
// 128 x 128 blocks and the transposed 128 x 1 token blocks: one CTA of 256 threads per 128 x 128. The block maximum is amax_update's (an unsigned maximum of the magnitudes' bits: the
// same value in any order, NaN winning), then every element is encoded as the spec does (its
// scale and inverse functions, the hardware conversion, which is the spec's encode bit for bit).
#include "gemm/fp8_quantize.h"

#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/fp8_cvt.cuh"
#include "gemm/fp8_quantize_common.cuh"
#include "mok/errors.hpp"

namespace mok::gemm {
namespace {
using namespace quant;


// kCols-wide row blocks, kCols / 32 consecutive elements per lane, kRowUnroll blocks per warp and
// step (their loads issued together). RowMode::Mx: E8M0 scale codes; MxReblocked (kCols 128): the
// block's four MX blocks quantized as MXFP8, then re-encoded at their largest scale, which is the
// block's fp32 scale (fp8::reblock_mxfp8's rule; 8 lanes per MX block); else fp32 scales by `rule`.
// The general form (any alignment, MXFP8); 1 x 128 blocks of aligned buffers take
// quantize_rows_vec_kernel.
constexpr int kRowUnroll = 4;
enum class RowMode { Blocked, Mx, MxReblocked };
template <int kCols, RowMode kMode>
__global__ void __launch_bounds__(256) quantize_rows_kernel(const uint16_t* in, int64_t rows, int64_t cols,
                                                            fp8::ScaleRule rule, uint8_t* q, void* scales) {
  static_assert(kMode != RowMode::MxReblocked || kCols == fp8::kBlock, "re-blocked MX: 1 x 128 blocks");
  constexpr bool kMx = kMode == RowMode::Mx;
  constexpr int kPer = kCols / 32;
  const int64_t grid_cols = (cols + kCols - 1) / kCols;
  const int64_t blocks = rows * grid_cols;
  const uint32_t lane = threadIdx.x % 32u;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32u);
  for (int64_t b0 = int64_t(blockIdx.x) * (blockDim.x / 32u) + threadIdx.x / 32u; b0 < blocks;
       b0 += warps * kRowUnroll) {
    float v[kRowUnroll][kPer];
    int64_t rows_of[kRowUnroll], c0_of[kRowUnroll];  // each block's row and this lane's first column
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t b = b0 + u * warps;
      const int64_t r = b / grid_cols;
      const int64_t c0 = (b - r * grid_cols) * kCols + int64_t(lane) * kPer;
      rows_of[u] = r;
      c0_of[u] = c0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[u][i] = b < blocks && c0 + i < cols ? bf16_at(in + r * cols + c0 + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t b = b0 + u * warps;
      if (b >= blocks) break;  // (warp-uniform)
      const int64_t r = rows_of[u], c0 = c0_of[u];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) amax = fp8::amax_update(amax, v[u][i]);
      [[maybe_unused]] const float amax_lane = amax;
      if constexpr (kMode != RowMode::MxReblocked) amax = warp_amax(amax);
      uint8_t* out = q + r * cols;
      if constexpr (kMode == RowMode::MxReblocked) {
        // This lane's MX block is lane / 8: its amax over 8 lanes, its E8M0 code, then the largest
        // code of the four (NaN, 0xff, is the largest code: it wins as the spec's NaN block does).
        float sub = amax_lane;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) sub = fp8::amax_update(sub, __shfl_xor_sync(0xffffffffu, sub, o));
        const uint8_t sc = fp8::mxfp8_scale_code(sub);
        uint32_t top = sc;
        top = max(top, __shfl_xor_sync(0xffffffffu, top, 8));
        top = max(top, __shfl_xor_sync(0xffffffffu, top, 16));
        const bool nan = top == fp8::kE8m0NaN;
        if (lane == 0) static_cast<float*>(scales)[b] = nan ? __uint_as_float(0x7fc00000u) : fp8::e8m0_decode(uint8_t(top));
        const int d = int(sc) - int(top);  // <= 0
        const float f = d >= -149 ? fp8::detail::pow2(d) : 0.0f, inv = fp8::mxfp8_inv_scale(sc);
        static_assert(kPer % 2 == 0, "pairs of codes");
#pragma unroll
        for (int i = 0; i < kPer; i += 2) {
          const uint16_t two = nan ? uint16_t(0x7f7f) : mx_reblocked2(v[u][i], v[u][i + 1], inv, f);
          if (c0 + i < cols) out[c0 + i] = uint8_t(two);
          if (c0 + i + 1 < cols) out[c0 + i + 1] = uint8_t(two >> 8);
        }
      } else if constexpr (kMx) {
        const uint8_t sc = fp8::mxfp8_scale_code(amax);
        if (lane == 0) static_cast<uint8_t*>(scales)[b] = sc;
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (c0 + i < cols) out[c0 + i] = fp8::mxfp8_encode(v[u][i], sc);
      } else {
        const float sc = fp8::block_scale(amax, rule), inv = fp8::block_inverse(sc);
        if (lane == 0) static_cast<float*>(scales)[b] = sc;
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (c0 + i < cols) out[c0 + i] = e4m3(v[u][i] * inv);
      }
    }
  }
}

// 1 x 128 blocks of aligned buffers (cols a multiple of 16; `in` and `q` 16-byte aligned): a warp
// walks whole rows, 8 lanes per block with 16 elements each (two 16-byte loads, one 16-byte store
// of codes), 4 blocks per step and two steps' loads in flight. The per-block work (the maximum's
// shuffles, the scale and its inverse) is spread over 16 elements per lane instead of 4, and no
// block index is divided: the general form above ran at 1.35 TB/s on d_y (one H200), bound by
// its instructions, not by the memory.
constexpr int kVecLanes = 8, kVecPer = fp8::kBlock / kVecLanes, kVecSteps = 2;  // 16 elements per lane
__device__ __forceinline__ void unpack_bf16x8(const uint4& w, float* v) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(u[i] << 16);
    v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
// kMx: MXFP8 re-blocked (quantize_mxfp8_reblocked's rows): a lane pair holds one 32-element MX
// block, its E8M0 code from the pair's maximum, the block's largest code over the 8 lanes (NaN,
// 0xff, wins), each code moved to it (mx_reblocked2); `rule` unused.
template <bool kMx>
__global__ void __launch_bounds__(256) quantize_rows_vec_kernel(const uint16_t* in, int64_t rows, int64_t cols,
                                                                fp8::ScaleRule rule, uint8_t* q, float* scales) {
  constexpr int kGroups = 32 / kVecLanes;  // blocks per warp and step
  const int64_t grid_cols = (cols + fp8::kBlock - 1) / fp8::kBlock;
  const uint32_t lane = threadIdx.x % 32u, sub = lane / kVecLanes, li = lane % kVecLanes;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32u);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32u) + threadIdx.x / 32u; r < rows; r += warps) {
    const uint16_t* row = in + r * cols;
    uint8_t* out = q + r * cols;
    float* srow = scales + r * grid_cols;
    for (int64_t cb = 0; cb < grid_cols; cb += kGroups * kVecSteps) {
      uint4 w[kVecSteps][2];
#pragma unroll
      for (int u = 0; u < kVecSteps; ++u) {
        const int64_t b = cb + u * kGroups + sub, c0 = b * fp8::kBlock + li * kVecPer;
        w[u][0] = w[u][1] = make_uint4(0u, 0u, 0u, 0u);  // past the edge: zeros
        if (c0 < cols) {  // (cols a multiple of 16: all 16 elements are inside)
          w[u][0] = __ldg(reinterpret_cast<const uint4*>(row + c0));
          w[u][1] = __ldg(reinterpret_cast<const uint4*>(row + c0 + 8));
        }
      }
#pragma unroll
      for (int u = 0; u < kVecSteps; ++u) {
        if (cb + u * kGroups >= grid_cols) break;  // (warp-uniform)
        const int64_t b = cb + u * kGroups + sub, c0 = b * fp8::kBlock + li * kVecPer;
        float v[kVecPer];
        unpack_bf16x8(w[u][0], v);
        unpack_bf16x8(w[u][1], v + 8);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kVecPer; ++i) amax = fp8::amax_update(amax, v[i]);
        uint32_t code[4];
        if constexpr (kMx) {
          amax = fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the lane pair's MX block
          const uint8_t mx = fp8::mxfp8_scale_code(amax);
          uint32_t top = mx;
          top = max(top, __shfl_xor_sync(0xffffffffu, top, 2));
          top = max(top, __shfl_xor_sync(0xffffffffu, top, 4));
          const bool nan = top == fp8::kE8m0NaN;
          if (b < grid_cols && li == 0) srow[b] = fp8::e8m0_decode(uint8_t(top));  // 2^e, or NaN
          const int d = int(mx) - int(top);  // <= 0
          const float f = d >= -149 ? fp8::detail::pow2(d) : 0.0f, inv = fp8::mxfp8_inv_scale(mx);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            code[i] = nan ? 0x7f7f7f7fu
                          : uint32_t(mx_reblocked2(v[4 * i], v[4 * i + 1], inv, f)) |
                                (uint32_t(mx_reblocked2(v[4 * i + 2], v[4 * i + 3], inv, f)) << 16);
        } else {
#pragma unroll
          for (int o = kVecLanes / 2; o > 0; o >>= 1)
            amax = fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          const float sc = fp8::block_scale(amax, rule), inv = fp8::block_inverse(sc);
          if (b < grid_cols && li == 0) srow[b] = sc;
#pragma unroll
          for (int i = 0; i < 4; ++i)
            code[i] = uint32_t(block_encode_inv2(v[4 * i], v[4 * i + 1], inv)) |
                      (uint32_t(block_encode_inv2(v[4 * i + 2], v[4 * i + 3], inv)) << 16);
        }
        if (c0 < cols) *reinterpret_cast<uint4*>(out + c0) = make_uint4(code[0], code[1], code[2], code[3]);
      }
    }
  }
}

// 128 x 128 blocks, one CTA each: thread t takes column t % 128 of rows t / 128, t / 128 + 2, ...
__global__ void __launch_bounds__(kTileThreads) quantize_tiles_kernel(const uint16_t* in, int64_t rows, int64_t cols,
                                                                      fp8::ScaleRule rule, uint8_t* q, float* scales) {
  constexpr int kB = fp8::kBlock, kRowsPer = kB * kB / kTileThreads;  // 64 elements per thread
  __shared__ float warp_max[kTileThreads / 32];
  const int64_t grid_cols = (cols + kB - 1) / kB;
  const int64_t br = blockIdx.x / grid_cols, bc = blockIdx.x - br * grid_cols;
  const int64_t c = bc * kB + threadIdx.x % kB;
  const int64_t r0 = br * kB + threadIdx.x / kB;
  float amax = 0.0f;
  for (int i = 0; i < kRowsPer; ++i) {
    const int64_t r = r0 + 2 * i;
    if (r < rows && c < cols) amax = fp8::amax_update(amax, bf16_at(in + r * cols + c));
  }
  amax = warp_amax(amax);
  if (threadIdx.x % 32u == 0) warp_max[threadIdx.x / 32u] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) amax = fp8::amax_update(amax, warp_max[w]);
  const float s = fp8::block_scale(amax, rule), inv = fp8::block_inverse(s);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  for (int i = 0; i < kRowsPer; ++i) {
    const int64_t r = r0 + 2 * i;
    if (r < rows && c < cols) q[r * cols + c] = e4m3(bf16_at(in + r * cols + c) * inv);
  }
}

// MXFP8 re-blocked to 128 x 128 (the weights' blocks), one CTA per block, the layout of
// quantize_tiles_kernel: warp w holds columns 32 (w % 4) .. +31 — one MX block — of the rows of
// parity w / 4, so a row's MX maximum is one warp reduction (REDUX over the magnitudes' bits:
// amax_update's maximum). First pass: every (row, MX block)'s E8M0 code into shared memory and
// the block's largest code (NaN, 0xff, the largest: it wins); second pass: the codes re-encoded
// at it (fp8::reblock_mxfp8's rule), the scale 2^e_max (or NaN).
__global__ void __launch_bounds__(kTileThreads) quantize_mx_tiles_reblocked_kernel(const uint16_t* in, int64_t rows,
                                                                                   int64_t cols, uint8_t* q,
                                                                                   float* scales) {
  constexpr int kB = fp8::kBlock, kRowsPer = kB * kB / kTileThreads;  // 64 rows per thread, one column
  __shared__ uint8_t mx_code[kB][kB / fp8::kMxBlock];
  __shared__ uint32_t warp_top[kTileThreads / 32];
  const int64_t grid_cols = (cols + kB - 1) / kB;
  const int64_t br = blockIdx.x / grid_cols, bc = blockIdx.x - br * grid_cols;
  const int cl = int(threadIdx.x % kB), rl0 = int(threadIdx.x / kB);  // column, first row in the block
  const int64_t c = bc * kB + cl;
  const uint32_t lane = threadIdx.x % 32u;
  uint32_t top = 0;
  for (int i = 0; i < kRowsPer; ++i) {
    const int rl = rl0 + 2 * i;
    const int64_t r = br * kB + rl;
    const float v = r < rows && c < cols ? bf16_at(in + r * cols + c) : 0.0f;
    const uint32_t m = __reduce_max_sync(0xffffffffu, __float_as_uint(v) & 0x7fffffffu);
    const uint8_t sc = fp8::mxfp8_scale_code(__uint_as_float(m));
    if (lane == 0) mx_code[rl][cl / fp8::kMxBlock] = sc;
    top = max(top, uint32_t(sc));
  }
  if (lane == 0) warp_top[threadIdx.x / 32u] = top;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) top = max(top, warp_top[w]);
  const bool nan = top == fp8::kE8m0NaN;
  if (threadIdx.x == 0) scales[blockIdx.x] = nan ? __uint_as_float(0x7fc00000u) : fp8::e8m0_decode(uint8_t(top));
  for (int i = 0; i < kRowsPer; ++i) {
    const int rl = rl0 + 2 * i;
    const int64_t r = br * kB + rl;
    if (r >= rows || c >= cols) continue;
    const uint8_t sc = mx_code[rl][cl / fp8::kMxBlock];
    const int d = int(sc) - int(top);  // <= 0
    const float f = d >= -149 ? fp8::detail::pow2(d) : 0.0f;
    q[r * cols + c] =
        nan ? fp8::kE4m3NaN : uint8_t(mx_reblocked2(bf16_at(in + r * cols + c), 0.0f, fp8::mxfp8_inv_scale(sc), f));
  }
}

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
// shared memory; the codes go out by rows through shared memory as 16-byte runs. Then every row of the matrix is read (the row form quantizes padding rows as
// they are, the token form masks them). `g.peers`: the rows are read where they live (RowGather).
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
    const int d = int(sc) - int(top);  // <= 0
    f = d >= -149 ? fp8::detail::pow2(d) : 0.0f;
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
__global__ void __launch_bounds__(kTileThreads, kPairs && !kRowForm ? (kMx ? 3 : 4) : 1) quantize_token_blocks_t_kernel(const uint16_t* in, int64_t rows,
                                                                               int64_t cols, int64_t ld, uint8_t* q_t,
                                                                               float* scales, RoutedSegments seg,
                                                                               bool vec_store, RowForm rf,
                                                                               RowGather g) {
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
    row_end = e < 0 ? 0 : min(rows, int64_t(__ldg(seg.expert_row_begin + e)) + __ldg(seg.expert_rows + e));
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

void check_args(const void* in, int64_t rows, int64_t cols, const void* q, const void* scales) {
  MOK_REQUIRE(rows >= 0, "rows", "rows >= 0 (rows = ", rows, ")");
  MOK_REQUIRE(cols >= 0, "cols", "cols >= 0 (cols = ", cols, ")");
  const bool any = rows > 0 && cols > 0;
  MOK_REQUIRE(!any || in != nullptr, "in", "not null when rows * cols > 0");
  MOK_REQUIRE(!any || q != nullptr, "q", "not null when rows * cols > 0");
  MOK_REQUIRE(!any || scales != nullptr, "scales", "not null when rows * cols > 0");
}

// 8 warps per CTA, kRowUnroll blocks per warp and step, at most 4096 CTAs (grid-stride).
int row_grid(int64_t blocks) {
  return static_cast<int>(std::min<int64_t>((blocks + 8 * kRowUnroll - 1) / (8 * kRowUnroll), 4096));
}

// What the block-scaled entry points check (check_args, and block_rows 1 or 128).
void check_block_args(const void* in, int64_t rows, int64_t cols, int block_rows, const void* q, const void* scales) {
  check_args(in, rows, cols, q, scales);
  MOK_REQUIRE(block_rows == 1 || block_rows == fp8::kBlock, "block_rows", "1 (1 x 128 blocks) or 128 (128 x 128), got ",
              block_rows);
}

// One CTA per 128 x 128 block.
unsigned tile_grid(int64_t rows, int64_t grid_cols) {
  const int64_t tiles = (rows + fp8::kBlock - 1) / fp8::kBlock * grid_cols;
  MOK_REQUIRE(tiles < (int64_t(1) << 31), "rows, cols", "fewer than 2^31 blocks of 128 x 128, got ", tiles);
  return static_cast<unsigned>(tiles);
}


}  // namespace

void quantize_fp8_blocked(const void* in_bf16, int64_t rows, int64_t cols, int block_rows, fp8::ScaleRule rule,
                          void* q, float* scales, cudaStream_t stream) {
  check_block_args(in_bf16, rows, cols, block_rows, q, scales);
  if (rows == 0 || cols == 0) return;
  const auto* in = static_cast<const uint16_t*>(in_bf16);
  auto* out = static_cast<uint8_t*>(q);
  const int64_t grid_cols = (cols + fp8::kBlock - 1) / fp8::kBlock;
  if (block_rows == 1) {
    if (cols % 16 == 0 && aligned(in, 16) && aligned(out, 16)) {
      const int grid = static_cast<int>(std::min<int64_t>((rows + 7) / 8, 4096));  // a warp per row
      quantize_rows_vec_kernel<false><<<grid, 256, 0, stream>>>(in, rows, cols, rule, out, scales);
    } else {
      quantize_rows_kernel<fp8::kBlock, RowMode::Blocked><<<row_grid(rows * grid_cols), 256, 0, stream>>>(in, rows, cols, rule,
                                                                                              out, scales);
    }
  } else {
    quantize_tiles_kernel<<<tile_grid(rows, grid_cols), kTileThreads, 0, stream>>>(in, rows, cols, rule, out, scales);
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

namespace {
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
  quantize_token_blocks_t_kernel<kPairs, kRowForm, kGather, kMx><<<static_cast<unsigned>(tiles), kTileThreads, 0, stream>>>(
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

void quantize_mxfp8(const void* in_bf16, int64_t rows, int64_t cols, void* q, uint8_t* scales, cudaStream_t stream) {
  check_args(in_bf16, rows, cols, q, scales);
  if (rows == 0 || cols == 0) return;
  const int64_t grid_cols = (cols + fp8::kMxBlock - 1) / fp8::kMxBlock;
  quantize_rows_kernel<fp8::kMxBlock, RowMode::Mx><<<row_grid(rows * grid_cols), 256, 0, stream>>>(
      static_cast<const uint16_t*>(in_bf16), rows, cols, fp8::ScaleRule::Fp32, static_cast<uint8_t*>(q), scales);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void quantize_mxfp8_reblocked(const void* in_bf16, int64_t rows, int64_t cols, int block_rows, void* q,
                              float* scales, cudaStream_t stream) {
  check_block_args(in_bf16, rows, cols, block_rows, q, scales);
  if (rows == 0 || cols == 0) return;
  const auto* in = static_cast<const uint16_t*>(in_bf16);
  auto* out = static_cast<uint8_t*>(q);
  const int64_t grid_cols = (cols + fp8::kBlock - 1) / fp8::kBlock;
  if (block_rows == 1 && cols % 16 == 0 && aligned(in, 16) && aligned(out, 16)) {
    const int grid = static_cast<int>(std::min<int64_t>((rows + 7) / 8, 4096));  // a warp per row
    quantize_rows_vec_kernel<true><<<grid, 256, 0, stream>>>(in, rows, cols, fp8::ScaleRule::Fp32, out, scales);
  } else if (block_rows == 1) {
    quantize_rows_kernel<fp8::kBlock, RowMode::MxReblocked><<<row_grid(rows * grid_cols), 256, 0, stream>>>(
        in, rows, cols, fp8::ScaleRule::Fp32, out, scales);
  } else {
    quantize_mx_tiles_reblocked_kernel<<<tile_grid(rows, grid_cols), kTileThreads, 0, stream>>>(in, rows, cols, out,
                                                                                                  scales);
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
