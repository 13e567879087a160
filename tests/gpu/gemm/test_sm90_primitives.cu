// Unit tests of the SM90 primitives in src/gemm/sm90.cuh, one kernel per wrapper: elect.sync,
// named barriers, setmaxnreg, mbarrier phases, TMA loads (2-D, 3-D, out-of-bounds fill) and
// stores into/from the 128-byte swizzle, stmatrix with the wgmma accumulator layout, and wgmma
// m64nNk16 with K-major and MN-major operands against an fp64 product.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gemm/engine.cuh"
#include "gemm/sm90.cuh"
#include "gemm/tensor_map.h"
#include "gemm_test_util.h"
#include "gpu_test_util.h"

namespace {

using namespace mok::gemm::sm90;
using mok::test::DevBuf;
using mok::test::download;
using mok::test::float_of;
using mok::test::upload;

__device__ __forceinline__ uint8_t* align1024(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 1023u) & ~uintptr_t(1023u));
}

// ---------------------------------------------------------------------------------------------
// elect.sync
// ---------------------------------------------------------------------------------------------
__global__ void elect_kernel(int* per_warp) {
  if (elect_one()) atomicAdd(per_warp + threadIdx.x / 32, 1);
}

TEST(Sm90Primitives, ElectOneLanePerWarp) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(8 * sizeof(int));
  MOK_ASSERT_CUDA(cudaMemset(d.p, 0, d.bytes));
  elect_kernel<<<1, 256>>>(d.as<int>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  for (int c : download<int>(d, 8)) EXPECT_EQ(c, 1);
}

// ---------------------------------------------------------------------------------------------
// Named barriers: warps 0-3 write, arrive; warps 4-7 sync, read.
// ---------------------------------------------------------------------------------------------
__global__ void named_barrier_kernel(int* out) {
  __shared__ int buf[128];
  for (int round = 0; round < 4; ++round) {
    if (threadIdx.x < 128) {
      buf[threadIdx.x] = int(threadIdx.x) * 3 + 1 + round;
      named_bar_arrive(1, 256);
      named_bar_sync(2, 256);  // wait until the readers are done before the next round
    } else {
      named_bar_sync(1, 256);
      out[round * 128 + threadIdx.x - 128] = buf[(threadIdx.x - 128 + 5) % 128];
      named_bar_arrive(2, 256);
    }
  }
}

TEST(Sm90Primitives, NamedBarriersOrderProducersAndConsumers) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(4 * 128 * sizeof(int));
  named_barrier_kernel<<<1, 256>>>(d.as<int>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto v = download<int>(d, 4 * 128);
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 128; ++i) EXPECT_EQ(v[r * 128 + i], ((i + 5) % 128) * 3 + 1 + r);
}

// named_bar_and: two groups of 128 threads on their own barriers (as the megakernel's consumer
// warpgroups); round r clears the predicate of thread (r * 37) % 128 in group 0 only (none in
// round 0), so group 0 must see false from round 1 on and group 1 always true, in every thread.
__global__ void named_bar_and_kernel(int* out) {
  const uint32_t group = threadIdx.x / 128u, t = threadIdx.x % 128u;
  for (int round = 0; round < 4; ++round) {
    const bool pred = !(group == 0 && round > 0 && t == uint32_t(round * 37) % 128u);
    out[round * 256 + int(threadIdx.x)] = named_bar_and(1u + group, 128, pred) ? 1 : 0;
  }
}

TEST(Sm90Primitives, NamedBarrierAndAgreesPerGroup) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(4 * 256 * sizeof(int));
  named_bar_and_kernel<<<1, 256>>>(d.as<int>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto v = download<int>(d, 4 * 256);
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 256; ++i) EXPECT_EQ(v[r * 256 + i], i < 128 && r > 0 ? 0 : 1) << "round " << r << " thread " << i;
}

// ---------------------------------------------------------------------------------------------
// setmaxnreg: the 40/232 split of the engine; the consumer branch keeps a large live array.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(384, 1) setmaxnreg_kernel(const float* in, float* out) {
  if (threadIdx.x < 128) {
    setmaxnreg_dec<40>();
    out[threadIdx.x] = float(threadIdx.x);
  } else {
    setmaxnreg_inc<232>();
    float v[160];
#pragma unroll
    for (int i = 0; i < 160; ++i) v[i] = in[(threadIdx.x + i) % 256];
    float s = 0;
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
      for (int i = 0; i < 160; ++i) {
        v[i] = v[i] * 0.5f + v[(i + 1) % 160];
        s += v[i];
      }
    out[threadIdx.x] = s;
  }
}

TEST(Sm90Primitives, SetmaxnregSplitRuns) {
  MOK_REQUIRE_GPUS(1);
  std::vector<float> in(256);
  for (int i = 0; i < 256; ++i) in[i] = float(i % 7) * 0.25f;
  DevBuf din(256 * 4), dout(384 * 4);
  upload(din, in);
  setmaxnreg_kernel<<<1, 384>>>(din.as<float>(), dout.as<float>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto out = download<float>(dout, 384);
  for (int t = 0; t < 128; ++t) EXPECT_EQ(out[t], float(t));
  for (int t = 128; t < 384; ++t) {
    float v[160];
    for (int i = 0; i < 160; ++i) v[i] = in[(t + i) % 256];
    float s = 0;
    for (int r = 0; r < 3; ++r)
      for (int i = 0; i < 160; ++i) {
        v[i] = v[i] * 0.5f + v[(i + 1) % 160];
        s += v[i];
      }
    EXPECT_NEAR(out[t], s, 1e-3f * std::fabs(s) + 1e-3f) << "thread " << t;
  }
}

// ---------------------------------------------------------------------------------------------
// mbarrier: two arrivals complete a phase; parities alternate.
// ---------------------------------------------------------------------------------------------
__global__ void mbarrier_kernel(int* out) {
  __shared__ uint64_t bar;
  __shared__ int data[2];
  if (threadIdx.x == 0) {
    mbar_init(&bar, 2);
    mbar_fence_init();
  }
  __syncthreads();
  const WaitBound wb{};
  for (int phase = 0; phase < 3; ++phase) {
    if (threadIdx.x == 0 || threadIdx.x == 32) {
      data[threadIdx.x / 32] = 10 * phase + int(threadIdx.x / 32);
      mbar_arrive(&bar);
    }
    if (threadIdx.x >= 64) {
      mbar_wait(&bar, uint32_t(phase & 1), wb, 1);
      if (threadIdx.x == 64) out[phase] = data[0] + data[1];
    }
    __syncthreads();
  }
}

TEST(Sm90Primitives, MbarrierPhases) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(3 * sizeof(int));
  mbarrier_kernel<<<1, 96>>>(d.as<int>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto v = download<int>(d, 3);
  for (int p = 0; p < 3; ++p) EXPECT_EQ(v[p], 20 * p + 1);
}

// A wait that can never complete returns after the bound and records its site.
__global__ void bounded_wait_kernel(unsigned int* err) {
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    mbar_fence_init();
  }
  __syncthreads();
  const WaitBound wb{err, 20ull * 1000 * 1000};  // 20 ms
  mbar_wait(&bar, 0, wb, 0x77);
}

TEST(Sm90Primitives, BoundedWaitRecordsTheSite) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(sizeof(unsigned));
  MOK_ASSERT_CUDA(cudaMemset(d.p, 0, d.bytes));
  bounded_wait_kernel<<<2, 64>>>(d.as<unsigned>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(download<unsigned>(d, 1)[0], 0x77u);
}

// ---------------------------------------------------------------------------------------------
// TMA loads into the 128B swizzle (2-D and 3-D), with out-of-bounds rows read as zero.
// ---------------------------------------------------------------------------------------------
__global__ void tma_load_kernel(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2,
                                uint32_t bytes, uint16_t* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* tile = align1024(raw);
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map);
    mbar_arrive_expect_tx(&bar, bytes);
    if (rank == 2)
      tma_load_2d(tile, &map, &bar, c0, c1);
    else
      tma_load_3d(tile, &map, &bar, c0, c1, c2);
  }
  mbar_wait(&bar, 0, WaitBound{}, 1);
  for (uint32_t i = threadIdx.x; i < bytes / 2; i += blockDim.x)
    out[i] = reinterpret_cast<const uint16_t*>(tile)[i];
}

void check_swizzled_tile(const std::vector<uint16_t>& got, int box_rows, const std::vector<uint16_t>& src,
                         int64_t src_rows, int64_t src_cols, int64_t row0, int64_t col0) {
  int bad = 0;
  for (int r = 0; r < box_rows; ++r)
    for (int c = 0; c < 64; ++c) {
      const uint16_t g = got[sw128_offset(uint32_t(r), uint32_t(c)) / 2];
      const int64_t sr = row0 + r, sc = col0 + c;
      const uint16_t want = (sr < src_rows && sc < src_cols) ? src[sr * src_cols + sc] : 0;
      if (g != want && bad++ < 5)
        ADD_FAILURE() << "tile(" << r << "," << c << ") = " << g << ", want " << want;
    }
  EXPECT_EQ(bad, 0);
}

TEST(Sm90Primitives, TmaLoad2dSwizzle128AndOutOfBounds) {
  MOK_REQUIRE_GPUS(1);
  const int64_t rows = 256, cols = 136;  // cols: 2 full boxes + 8
  std::vector<uint16_t> src(rows * cols);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(i * 7 + 1);
  DevBuf d(src.size() * 2), out(128 * 128);
  upload(d, src);
  const auto map = mok::gemm::make_map_2d(d.p, rows, cols, 128);
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(tma_load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  const int cases[3][2] = {{64, 128}, {0, 0}, {128, 200}};  // the last one: OOB in both dims
  for (const auto& c : cases) {
    tma_load_kernel<<<1, 128, 64 * 1024>>>(map, 2, c[0], c[1], 0, 128 * 128, out.as<uint16_t>());
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    check_swizzled_tile(download<uint16_t>(out, 128 * 64), 128, src, rows, cols, c[1], c[0]);
  }
}

TEST(Sm90Primitives, TmaLoad3dBatchCoordinate) {
  MOK_REQUIRE_GPUS(1);
  const int64_t batch = 3, rows = 300, cols = 128;
  std::vector<uint16_t> src(batch * rows * cols);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(i * 13 + 5);
  DevBuf d(src.size() * 2), out(256 * 128);
  upload(d, src);
  const auto map = mok::gemm::make_map_3d(d.p, batch, rows, cols, 256);
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(tma_load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  tma_load_kernel<<<1, 128, 64 * 1024>>>(map, 3, 64, 100, 2, 256 * 128, out.as<uint16_t>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> slice(src.begin() + 2 * rows * cols, src.begin() + 3 * rows * cols);
  check_swizzled_tile(download<uint16_t>(out, 256 * 64), 256, slice, rows, cols, 100, 64);
}

// ---------------------------------------------------------------------------------------------
// TMA store from the 128B swizzle, clipped at the tensor's bounds.
// ---------------------------------------------------------------------------------------------
__global__ void tma_store_kernel(const __grid_constant__ CUtensorMap map, int c0, int c1) {
  extern __shared__ uint8_t raw[];
  uint8_t* tile = align1024(raw);
  for (uint32_t i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    const uint32_t r = i / 64, c = i % 64;
    *reinterpret_cast<uint16_t*>(tile + sw128_offset(r, c)) = uint16_t(1000 + r * 64 + c);
  }
  fence_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_store_2d(&map, tile, c0, c1);
    tma_store_commit();
    tma_store_wait_all<0>();
  }
}

TEST(Sm90Primitives, TmaStore2dFromSwizzle128Clipped) {
  MOK_REQUIRE_GPUS(1);
  const int64_t rows = 100, cols = 104;
  DevBuf d(rows * cols * 2);
  MOK_ASSERT_CUDA(cudaMemset(d.p, 0, d.bytes));
  const auto map = mok::gemm::make_map_2d(d.p, rows, cols, 64);
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(tma_store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 32 * 1024));
  tma_store_kernel<<<1, 128, 32 * 1024>>>(map, 64, 60);  // rows 60..123, cols 64..127: clipped
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto v = download<uint16_t>(d, rows * cols);
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const bool in = r >= 60 && c >= 64;
      const uint16_t want = in ? uint16_t(1000 + (r - 60) * 64 + (c - 64)) : 0;
      if (v[r * cols + c] != want && bad++ < 5)
        ADD_FAILURE() << "(" << r << "," << c << ") = " << v[r * cols + c] << ", want " << want;
    }
  EXPECT_EQ(bad, 0);
}

// ---------------------------------------------------------------------------------------------
// stmatrix with the wgmma accumulator layout (engine's write_chunk_bf16 / write_chunk_swiglu).
// ---------------------------------------------------------------------------------------------
__host__ __device__ inline float fake_acc(int row, int col) { return float(row) * 0.5f + float(col) * 0.03125f - 7.0f; }

__global__ void stmatrix_kernel(uint16_t* out, int swiglu) {
  extern __shared__ uint8_t raw[];
  uint8_t* buf = align1024(raw);
  const uint32_t wt = threadIdx.x, warp = wt / 32, lane = wt % 32;
  float acc[128];
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = int(warp * 16 + lane / 4 + (c >= 2 ? 8 : 0));
      const int col = 8 * j + 2 * int(lane % 4) + (c & 1);
      acc[4 * j + c] = fake_acc(row, col);
    }
  if (swiglu)
    mok::gemm::engine::write_chunk_swiglu<0>(buf, acc, wt);
  else
    mok::gemm::engine::write_chunk_bf16<8>(buf, acc, wt);  // accumulator columns 64..127
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < 64 * 64; i += blockDim.x) out[i] = reinterpret_cast<const uint16_t*>(buf)[i];
}

TEST(Sm90Primitives, StmatrixChunkMatchesAccumulatorLayout) {
  MOK_REQUIRE_GPUS(1);
  DevBuf d(64 * 64 * 2);
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(stmatrix_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 1024));
  for (int swiglu = 0; swiglu < 2; ++swiglu) {
    stmatrix_kernel<<<1, 128, 16 * 1024>>>(d.as<uint16_t>(), swiglu);
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto v = download<uint16_t>(d, 64 * 64);
    int bad = 0;
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) {
        float want;
        if (!swiglu) {
          want = mok::round_bf16(fake_acc(r, 64 + c));
        } else {
          // h column c: gate = accumulator column 64*(c/32) + c%32 (packed order), up = that + 32.
          const int gc = 64 * (c / 32) + c % 32;
          const float g = mok::round_bf16(fake_acc(r, gc)), u = mok::round_bf16(fake_acc(r, gc + 32));
          want = mok::round_bf16(g / (1.0f + std::exp(-g)) * u);
        }
        const float got = float_of(v[sw128_offset(uint32_t(r), uint32_t(c)) / 2]);
        const bool ok = swiglu ? std::fabs(got - want) <= 0.0079f * std::fabs(want) + 1e-6f : got == want;
        if (!ok && bad++ < 5) ADD_FAILURE() << "swiglu=" << swiglu << " (" << r << "," << c << ") = " << got << ", want " << want;
      }
    EXPECT_EQ(bad, 0) << "swiglu=" << swiglu;
  }
}

// ---------------------------------------------------------------------------------------------
// wgmma m64nNk16 (4 K steps of 16 = one 64-wide K block) vs fp64, K-major and MN-major operands.
// A is [64 x 64] (M x K), B is [N x 64] (N x K); D = A . B^T.
// ---------------------------------------------------------------------------------------------
template <int N, bool kAMN, bool kBMN>
__global__ void wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             float* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* a = align1024(raw);
  uint8_t* b = a + 8192;
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(&bar, 8192 + N * 128);
    tma_load_2d(a, &map_a, &bar, 0, 0);  // K-major: {k, m}; MN-major: {m, k}
    if constexpr (!kBMN) {
      tma_load_3d(b, &map_b, &bar, 0, 0, 0);
    } else {
      for (int c = 0; c < N / 64; ++c) tma_load_3d(b + c * 8192, &map_b, &bar, 64 * c, 0, 0);
    }
  }
  mbar_wait(&bar, 0, WaitBound{}, 1);
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const uint32_t as = smem_addr(a), bs = smem_addr(b);
  fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) {
    const uint64_t da = kAMN ? desc_mn_major(as, k16, 8192) : desc_k_major(as, k16);
    const uint64_t db = kBMN ? desc_mn_major(bs, k16, 8192) : desc_k_major(bs, k16);
    wgmma_bf16<N, kAMN ? 1 : 0, kBMN ? 1 : 0>(acc, da, db, k16 > 0 ? 1u : 0u);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(acc);
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t row = warp * 16 + lane / 4 + (c >= 2 ? 8 : 0);
      const uint32_t col = 8 * j + 2 * (lane % 4) + (c & 1);
      out[row * N + col] = acc[4 * j + c];
    }
}

template <int N, bool kAMN, bool kBMN>
void run_wgmma_case() {
  SCOPED_TRACE(testing::Message() << "N=" << N << " A " << (kAMN ? "MN" : "K") << "-major, B "
                                  << (kBMN ? "MN" : "K") << "-major");
  const auto a = mok::test::random_bf16(64 * 64, 11 + N);   // logical A[m][k]
  const auto b = mok::test::random_bf16(N * 64, 23 + N);    // logical B[n][k]
  // Stored layouts: K-major A [m][k], MN-major A [k][m]; K-major B [n][k], MN-major B [k][n].
  std::vector<uint16_t> as(64 * 64), bs(N * 64);
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < 64; ++k) as[kAMN ? k * 64 + m : m * 64 + k] = a[m * 64 + k];
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < 64; ++k) bs[kBMN ? k * N + n : n * 64 + k] = b[n * 64 + k];
  DevBuf da(as.size() * 2), db(bs.size() * 2), dout(64 * N * 4);
  upload(da, as);
  upload(db, bs);
  const auto map_a = mok::gemm::make_map_2d(da.p, 64, 64, 64);
  const auto map_b = kBMN ? mok::gemm::make_map_3d(db.p, 1, 64, N, 64) : mok::gemm::make_map_3d(db.p, 1, N, 64, N);
  auto* kernel = wgmma_kernel<N, kAMN, kBMN>;
  MOK_ASSERT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
  kernel<<<1, 128, 48 * 1024>>>(map_a, map_b, dout.as<float>());
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto out = download<float>(dout, 64 * N);
  mok::test::ErrStat st;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < 64; ++k) ref += double(float_of(a[m * 64 + k])) * double(float_of(b[n * 64 + k]));
      st.add(out[m * N + n], ref);
    }
  EXPECT_EQ(st.nonfinite, 0);
  EXPECT_LT(st.rel(), 1e-5) << "fp32 accumulation of exact bf16 products";
}

TEST(Sm90Primitives, WgmmaKMajorBothOperands) {
  MOK_REQUIRE_GPUS(1);
  run_wgmma_case<256, false, false>();
  run_wgmma_case<128, false, false>();
  run_wgmma_case<64, false, false>();
  run_wgmma_case<8, false, false>();
}

TEST(Sm90Primitives, WgmmaMNMajorB) {
  MOK_REQUIRE_GPUS(1);
  run_wgmma_case<256, false, true>();
  run_wgmma_case<64, false, true>();
}

TEST(Sm90Primitives, WgmmaMNMajorAAndB) {
  MOK_REQUIRE_GPUS(1);
  run_wgmma_case<256, true, true>();
  run_wgmma_case<128, true, false>();
}

}  // namespace
