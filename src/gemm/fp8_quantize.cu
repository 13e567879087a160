// mok — FP8 quantization kernels (see fp8_quantize.h). Row blocks (1 x 128, MXFP8's 1 x 32): one
// warp per block, each lane holding consecutive elements, several blocks per warp in flight;
// 128 x 128 blocks: one CTA of 256 threads each (the transposed 128 x 1 token blocks:
// fp8_quantize_tokens.cu; the dgrads' weights: fp8_quantize_weights.cu). The block maximum is
// amax_update's (an unsigned maximum of the magnitudes' bits: the
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
        const float f = mx_shift(sc, top), inv = fp8::mxfp8_inv_scale(sc);
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
          const float f = mx_shift(mx, top), inv = fp8::mxfp8_inv_scale(mx);
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
    const float f = mx_shift(sc, top);
    q[r * cols + c] =
        nan ? fp8::kE4m3NaN : uint8_t(mx_reblocked2(bf16_at(in + r * cols + c), 0.0f, fp8::mxfp8_inv_scale(sc), f));
  }
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
