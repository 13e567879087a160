// mok — the FP8 dgrads' weight codes (see fp8_quantize.h): each expert's weight transposed
// (transpose_weights_bf16) and, in one pass, transposed and quantized per 128 x 128 block
// (quantize_fp8_weights_t), the same bits as the two steps.
#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/fp8_cvt.cuh"
#include "gemm/fp8_quantize.h"
#include "gemm/fp8_quantize_common.cuh"
#include "mok/errors.hpp"

namespace mok::gemm {
namespace {
using namespace quant;

// 32 x 32 tiles through shared memory (one CTA of 32 x 8 threads each): reads along the input's
// rows, writes along the output's. Packed (w_up given): output K index k reads input row i(k) of
// the gate or the up weight (32 gate rows, then 32 up rows, per 64 of k).
__global__ void __launch_bounds__(256) transpose_weights_kernel(const uint16_t* w, const uint16_t* w_up, int64_t rows,
                                                                int64_t cols, uint16_t* out) {
  __shared__ uint16_t tile[32][33];
  const int64_t k_out = w_up != nullptr ? 2 * rows : rows;  // the output's K (its row length)
  const int64_t e = blockIdx.z, k0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * 32;
  const int tx = int(threadIdx.x % 32u), ty = int(threadIdx.x / 32u);
  // Input rows for output K indices k0 .. k0 + 31 (one gate or up group: groups are 32 wide).
  const uint16_t* src = w;
  int64_t r0 = k0;
  if (w_up != nullptr) {
    src = (k0 / 32) % 2 == 0 ? w : w_up;
    r0 = (k0 / 64) * 32;
  }
  src += e * rows * cols;
  for (int i = ty; i < 32; i += 8) tile[i][tx] = src[(r0 + i) * cols + c0 + tx];
  __syncthreads();
  uint16_t* dst = out + e * cols * k_out;
  for (int i = ty; i < 32; i += 8) dst[(c0 + i) * k_out + k0 + tx] = tile[tx][i];
}

// The dgrads' K-major weight codes in one pass (quantize_fp8_weights_t): one CTA per 128 x 128
// output block (expert e, output rows = source columns [128 cb, +128), K = source rows [128 kb,
// +128), or with w_up the packed K order's 64 gate and 64 up rows). The block's 128 source rows
// are read as 16-byte runs into a shared [K][column] tile (the maximum taken on the way: order-
// free), then thread t encodes column t % 128 over 64 K of it (t / 128: which half) and stores
// its 64 codes as four 16-byte runs of the output row. 3 bytes of traffic per element instead of
// the two-step path's 7 (a bf16 transpose written and read again).
// kMx (MXFP8 re-blocked, the MXFP8 backward's dgrad weights): a thread's 64 K of its column are two
// MX blocks along K (32 | 64, and the packed order's 32-wide gate / up groups are whole MX blocks);
// their E8M0 codes from the shared tile, the block's largest code by a CTA maximum (NaN, 0xff,
// wins), and each code re-encoded at it (quantize_mxfp8_reblocked's rule), the scale 2^e or NaN.
constexpr int kWtPitch = fp8::kBlock + 8;  // bf16 per shared row: 16-byte runs stay aligned, column reads conflict-free
template <bool kMx>
__global__ void __launch_bounds__(kTileThreads) quantize_weights_t_kernel(const uint16_t* w, const uint16_t* w_up,
                                                                          int64_t rows, int64_t cols,
                                                                          fp8::ScaleRule rule, uint8_t* q_t,
                                                                          float* scales) {
  constexpr int kB = fp8::kBlock;
  __shared__ __align__(16) uint16_t tile[kB][kWtPitch];
  __shared__ float warp_max[kTileThreads / 32];
  const int64_t k_out = w_up != nullptr ? 2 * rows : rows;
  const int64_t kbs = k_out / kB, cbs = cols / kB;
  const int64_t e = blockIdx.x / (cbs * kbs), rest = blockIdx.x - e * cbs * kbs;
  const int64_t cb = rest / kbs, kb = rest - cb * kbs;
  const uint32_t t = threadIdx.x;
  float amax = 0.0f;
#pragma unroll
  for (int pass = 0; pass < kB / 16; ++pass) {  // 16 rows per pass, 16 threads x 8 bf16 per row
    const int k = pass * 16 + int(t / 16u), chunk = int(t % 16u);
    const int64_t kk = kb * kB + k;  // output K index
    const uint16_t* src = w;
    int64_t r = kk;
    if (w_up != nullptr) {  // packed: 32 gate rows, then 32 up rows, per 64 of K
      src = (kk / 32) % 2 == 0 ? w : w_up;
      r = (kk / 64) * 32 + kk % 32;
    }
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + (e * rows + r) * cols + cb * kB + chunk * 8));
    *reinterpret_cast<uint4*>(&tile[k][chunk * 8]) = v;
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      amax = fp8::amax_update(amax, __uint_as_float(u[i] << 16));
      amax = fp8::amax_update(amax, __uint_as_float(u[i] & 0xffff0000u));
    }
  }
  const int c = int(t % uint32_t(kB)), half = int(t / uint32_t(kB));
  uint8_t* dst = q_t + ((e * cols + cb * kB + c) * k_out + kb * kB + half * 64);
  if constexpr (kMx) {
    __shared__ uint32_t warp_top[kTileThreads / 32];
    __syncthreads();  // the tile
    uint8_t sc[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      float m = 0.0f;
#pragma unroll
      for (int k = 0; k < fp8::kMxBlock; ++k) m = fp8::amax_update(m, bf16_at(&tile[half * 64 + g * 32 + k][c]));
      sc[g] = fp8::mxfp8_scale_code(m);
    }
    uint32_t top = __reduce_max_sync(0xffffffffu, max(uint32_t(sc[0]), uint32_t(sc[1])));
    if (t % 32u == 0) warp_top[t / 32u] = top;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTileThreads / 32; ++i) top = max(top, warp_top[i]);
    const bool nan = top == fp8::kE8m0NaN;
    if (t == 0) scales[(e * cbs + cb) * kbs + kb] = fp8::e8m0_decode(uint8_t(top));
    float inv[2], f[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      f[g] = mx_shift(sc[g], top);
      inv[g] = fp8::mxfp8_inv_scale(sc[g]);
    }
    const auto mx2 = [&](int k) {  // K indices k, k + 1 of the thread's 64 (its MX block k / 32)
      return nan ? uint16_t(0x7f7f)
                 : mx_reblocked2(bf16_at(&tile[half * 64 + k][c]), bf16_at(&tile[half * 64 + k + 1][c]), inv[k / 32],
                                 f[k / 32]);
    };
#pragma unroll
    for (int run = 0; run < 4; ++run) {
      uint32_t code[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = run * 16 + 4 * i;
        code[i] = uint32_t(mx2(k)) | (uint32_t(mx2(k + 2)) << 16);
      }
      reinterpret_cast<uint4*>(dst)[run] = make_uint4(code[0], code[1], code[2], code[3]);
    }
    return;
  }
  amax = warp_amax(amax);
  if (t % 32u == 0) warp_max[t / 32u] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kTileThreads / 32; ++i) amax = fp8::amax_update(amax, warp_max[i]);
  const float sc = fp8::block_scale(amax, rule), inv = fp8::block_inverse(sc);
  if (t == 0) scales[(e * cbs + cb) * kbs + kb] = sc;  // quantize_fp8_blocked's grid over [E * cols, k_out]
#pragma unroll
  for (int run = 0; run < 4; ++run) {
    uint32_t code[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = half * 64 + run * 16 + 4 * i;
      code[i] = uint32_t(block_encode_inv2(bf16_at(&tile[k][c]), bf16_at(&tile[k + 1][c]), inv)) |
                (uint32_t(block_encode_inv2(bf16_at(&tile[k + 2][c]), bf16_at(&tile[k + 3][c]), inv)) << 16);
    }
    reinterpret_cast<uint4*>(dst)[run] = make_uint4(code[0], code[1], code[2], code[3]);
  }
}

}  // namespace

void transpose_weights_bf16(const void* w, const void* w_up, int64_t experts, int64_t rows, int64_t cols, void* out,
                            cudaStream_t stream) {
  MOK_REQUIRE(experts >= 0, "experts", ">= 0, got ", experts);
  MOK_REQUIRE(rows >= 0 && rows % 32 == 0 && cols >= 0 && cols % 32 == 0, "rows, cols",
              "multiples of 32 (whole tiles and gate/up groups), got ", rows, " x ", cols);
  const bool any = experts > 0 && rows > 0 && cols > 0;
  MOK_REQUIRE(!any || (w != nullptr && out != nullptr), "w, out", "not null when there are elements");
  MOK_REQUIRE(experts < 65536 && cols / 32 < (int64_t(1) << 31) && (w_up ? 2 * rows : rows) / 32 < 65536,
              "experts, rows", "fewer than 65536 experts and 2^21 rows (the grid)");
  if (!any) return;
  const dim3 grid(unsigned(cols / 32), unsigned((w_up ? 2 * rows : rows) / 32), unsigned(experts));
  transpose_weights_kernel<<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(w),
                                                    static_cast<const uint16_t*>(w_up), rows, cols,
                                                    static_cast<uint16_t*>(out));
  MOK_CUDA_CHECK(cudaGetLastError());
}

void quantize_fp8_weights_t(const void* w, const void* w_up, int64_t experts, int64_t rows, int64_t cols,
                            fp8::ScaleRule rule, void* q_t, float* scales, cudaStream_t stream, bool mx) {
  MOK_REQUIRE(experts >= 0 && rows >= 0 && cols >= 0, "experts, rows, cols", ">= 0, got ", experts, ", ", rows, ", ",
              cols);
  const int64_t k_out = w_up != nullptr ? 2 * rows : rows;
  MOK_REQUIRE(cols % fp8::kBlock == 0 && k_out % fp8::kBlock == 0, "rows, cols",
              "whole 128 x 128 output blocks: cols and the output's K (rows, 2 rows with w_up) multiples of 128, got ",
              rows, " x ", cols);
  const bool any = experts > 0 && rows > 0 && cols > 0;
  if (!any) return;
  MOK_REQUIRE(w != nullptr && q_t != nullptr && scales != nullptr, "w, q_t, scales", "not null when there are elements");
  MOK_REQUIRE(aligned(w, 16) && (w_up == nullptr || aligned(w_up, 16)) && aligned(q_t, 16), "w, w_up, q_t",
              "16-byte aligned (the one-pass kernel moves 16-byte runs)");
  const int64_t blocks = experts * (cols / fp8::kBlock) * (k_out / fp8::kBlock);
  MOK_REQUIRE(blocks < (int64_t(1) << 31), "experts, rows, cols", "fewer than 2^31 output blocks, got ", blocks);
  const auto kernel = mx ? quantize_weights_t_kernel<true> : quantize_weights_t_kernel<false>;
  kernel<<<static_cast<unsigned>(blocks), kTileThreads, 0, stream>>>(
      static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(w_up), rows, cols, rule,
      static_cast<uint8_t*>(q_t), scales);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
