// The engine's FP8 operand type (engine_mainloop.cuh, OperandE4m3) on one output tile: the engine's
// own producer (TMA loads of 128-byte K rows through UINT8 tensor maps) and consumer mainloop
// (m64nNk32 e4m3 wgmma, fp32 accumulators) over K = 128 .. 1024 (1 to 8 stages of 128 FP8 K
// elements, the ring wrapping), BLOCK_N 256 and 128, against an fp64 product of the values
// decoded by the spec (common/fp8_format.h). The inputs are finite E4M3 codes of magnitude 2^-3 .. 2^3 and their signs: every
// product is exact in fp32, so the error is the tensor cores' accumulation alone, which the test
// bounds loosely (Hopper's FP8 accumulation keeps fewer bits than fp32: the FP8 issue promotes it)
// and prints, and any layout or descriptor mistake is an O(1) error. No scales yet (issue 22).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/fp8_format.h"
#include "gemm/engine.cuh"
#include "gemm/tensor_map.h"
#include "gemm_test_util.h"
#include "gpu_test_util.h"

namespace {

using namespace mok::gemm::engine;
using mok::test::DevBuf;
using mok::test::download;
using mok::test::upload;

// One 128 x BLOCK_N tile of A [128, K] . B [BLOCK_N, K]^T (both K-major, E4M3) into out [128, N] f32.
template <class C>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_tile_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    int k_blocks, unsigned int* error, float* out) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem<C> sm = smem_view<C>(smem_raw);
  if (threadIdx.x == 0) init_barriers(sm);
  __syncthreads();
  const WaitBound wb{error, 2000000000ull};  // 2 s: a lost load fails the test instead of hanging
  const Tile t{0, 0, 0, 0, k_blocks, C::kBlockK, 0, 0};
  if (threadIdx.x < 128) {
    if (threadIdx.x == 0) {
      PipeState<C> ps;
      (void)produce_tile<C, false, false>(sm, ps, t, &map_a, &map_b, wb);
      drain_stages(sm, ps, wb);  // no load may still target this CTA's shared memory at exit
    }
    return;
  }
  const int cwg = int(threadIdx.x / 128u) - 1;
  const uint32_t wt = threadIdx.x % 128u, ct = threadIdx.x - 128u;
  PipeState<C> ps;
  Skew<C> skew;
  float acc[C::kAccRegs];
  mma_tile<C, false, false, false>(sm, ps, t, cwg, ct, acc, wb, skew);
  const int32_t row0 = 64 * cwg + acc_row(wt);
#pragma unroll
  for (int j = 0; j < C::kBlockN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int32_t row = row0 + (c >= 2 ? 8 : 0), col = 8 * j + acc_col(wt) + (c & 1);
      out[row * C::kBlockN + col] = acc[4 * j + c];
    }
}

// n finite codes of magnitude 2^-3 .. 2^3 (exponent fields 4 .. 10), random signs and mantissas.
std::vector<uint8_t> random_e4m3(size_t n, uint64_t seed) {
  mok::Rng rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) {
    const auto r = static_cast<uint32_t>(rng.uniform() * 16777216.0);
    b = static_cast<uint8_t>(((r & 1u) << 7) | ((4u + ((r >> 1) & 0xffu) % 7u) << 3) | ((r >> 12) & 7u));
  }
  return v;
}

template <int kBN>
void run_fp8_tile(int k_blocks) {
  using C = Cfg<kBN, OperandE4m3>;
  const int K = k_blocks * C::kBlockK;
  SCOPED_TRACE(testing::Message() << "BLOCK_N " << kBN << ", K " << K);
  const auto a = random_e4m3(size_t(128) * K, 31 + K), b = random_e4m3(size_t(kBN) * K, 57 + K + kBN);
  DevBuf da(a.size()), db(b.size()), dout(size_t(128) * kBN * 4), err(4);
  upload(da, a);
  upload(db, b);
  MOK_ASSERT_CUDA(cudaMemset(dout.p, 0xff, dout.bytes));
  MOK_ASSERT_CUDA(cudaMemset(err.p, 0, 4));
  using mok::gemm::MapType;
  const auto map_a = mok::gemm::make_map_2d(da.p, 128, uint64_t(K), 128, MapType::E4M3);
  const auto map_b = mok::gemm::make_map_3d(db.p, 1, kBN, uint64_t(K), kBN, MapType::E4M3);
  auto* kernel = fp8_tile_kernel<C>;
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
  kernel<<<1, kThreads, C::kSmemBytes>>>(map_a, map_b, k_blocks, err.as<unsigned>(), dout.as<float>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  const auto out = download<float>(dout, size_t(128) * kBN);
  double worst = 0;  // |out - ref| / sum |a b| over the tile
  int64_t nonfinite = 0;
  for (int m = 0; m < 128; ++m)
    for (int n = 0; n < kBN; ++n) {
      double ref = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const double p = double(mok::fp8::e4m3_decode(a[size_t(m) * K + k])) *
                         double(mok::fp8::e4m3_decode(b[size_t(n) * K + k]));
        ref += p;
        mag += std::fabs(p);
      }
      const float got = out[size_t(m) * kBN + n];
      if (!std::isfinite(got)) {
        ++nonfinite;
        continue;
      }
      worst = std::max(worst, std::fabs(double(got) - ref) / mag);
    }
  EXPECT_EQ(nonfinite, 0) << "unwritten or NaN outputs";
  EXPECT_LT(worst, 1e-2) << "FP8 tile vs fp64, relative to sum |a b|";
  std::printf("[fp8 tile] BLOCK_N %d K %d: max |err| / sum |a b| = %.2e\n", kBN, K, worst);
}

TEST(EngineFp8, OneTileMatchesFp64) {
  MOK_REQUIRE_GPUS(1);
  for (int kb : {1, 3, 8}) run_fp8_tile<256>(kb);
  for (int kb : {1, 7}) run_fp8_tile<128>(kb);
}

}  // namespace
