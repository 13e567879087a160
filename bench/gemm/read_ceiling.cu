// mok_read_ceiling — the fastest read-only DRAM stream this GPU sustains, measured three ways, and
// the fastest write-only stream (three writers, below).
//
// The grouped GEMM at 128 rows per expert is a weight-streaming problem: every weight byte is read
// once and used for only 128 rows. Its time is bounded below by (bytes it must read) / (the best
// read rate the device reaches), so a benchmark bar that needs a higher read rate is out of reach
// for any kernel that reads the weights once. bench/gemm/roofline.py uses the figure measured
// here (`read_tbps`) for that bound. Three kinds of reader, each with a few shapes; the best one
// counts:
//   * ldg:  every thread streams 16-byte non-caching loads (ld.global.nc.L1::no_allocate), several
//           in flight per thread; a grid of `ctas per SM` x SMs;
//   * bulk: one thread per CTA keeps `stages` plain bulk copies (cp.async.bulk, `chunk` bytes of
//           contiguous memory each) in flight into shared memory, completing on mbarriers;
//   * tma:  the GEMM's own weight stream without the MMAs: a 3-D tensor map [E, N, K] (DeepSeek-V3
//           FC1: 32 x 4096 x 7168 bf16, 1.88 GB), boxes of 256 N rows x 64 K (32 KB, 128-byte
//           swizzle), tiles in the GEMM's raster order (groups of 8 experts, N outer), `stages`
//           boxes in flight per CTA.
// The loaded data is folded into a value that is stored, so nothing is optimised away; shared
// memory targets are simply overwritten. Every wait is bounded (2 s; a timeout is reported as an
// error, not a number).
// The write ceiling bounds the weight gradient over few rows per expert, whose bf16 dW is 2 bytes
// per 2K FLOPs (notes/gemm.md): at 256 rows per expert a 600 TF/s wgrad writes 2.3 TB/s. Writers:
//   * stg:       every thread streams 16-byte stores, grid-stride (whole lines per warp);
//   * memset:    cudaMemsetAsync over the buffer (the driver's own write stream);
//   * tma_store: the bf16 wgrad's output stream without the MMAs: TMA stores of {64 cols, 64 rows}
//                boxes (8 KB, from shared memory) into dW [32, 4096, 7168], 128 x 256 tiles of 8
//                boxes in the K-grouped raster (expert-major, groups of 8 M tiles, N outer), one
//                thread per CTA with `inflight` store groups reading shared memory at most.
//
//   mok_read_ceiling [--out read.json] [--reps N] [--gib G]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "util/parse_number.h"
#include "common/cuda_check.h"
#include "gemm/sm90.cuh"
#include "gemm/tensor_map.h"
#include "schedule/schedule_math.h"

namespace {

namespace sm90 = mok::gemm::sm90;
constexpr unsigned long long kWaitNs = 2000000000ull;

template <int kUnroll>
__global__ void ldg_read(const uint4* __restrict__ src, int64_t n16, unsigned* __restrict__ sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n16; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(src + i + u * stride));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) acc ^= src[i].x ^ src[i].w;
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicXor(sink, acc);
}

// One thread per CTA issues the copies; `issue(i, stage, bar)` starts copy i into a stage.
template <typename Issue>
__device__ void ring_read(int64_t copies, int stages, uint32_t bytes, unsigned* error, unsigned* sink,
                          Issue issue) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ uint64_t bars[16];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) sm90::mbar_init(&bars[s], 1);
  sm90::mbar_fence_init();
  const sm90::WaitBound wb{error, kWaitNs};
  int64_t issued = 0;
  for (int64_t i = blockIdx.x; i < copies; i += gridDim.x, ++issued) {
    const int s = int(issued % stages);
    if (issued >= stages && !sm90::mbar_wait(&bars[s], uint32_t((issued / stages - 1) & 1), wb, 1)) return;
    sm90::mbar_arrive_expect_tx(&bars[s], bytes);
    issue(i, smem + size_t(s) * bytes, &bars[s]);
  }
  // Drain: the CTA must not exit while a copy still targets its shared memory.
  for (int64_t j = issued > stages ? issued - stages : 0; j < issued; ++j) {
    const int s = int(j % stages);
    if (!sm90::mbar_wait(&bars[s], uint32_t((j / stages) & 1), wb, 2)) return;
  }
  atomicXor(sink, *reinterpret_cast<const unsigned*>(smem));
}

__global__ void bulk_read(const unsigned char* src, int64_t chunks, uint32_t chunk, int stages, unsigned* error,
                          unsigned* sink) {
  ring_read(chunks, stages, chunk, error, sink, [&](int64_t i, void* dst, uint64_t* bar) {
    sm90::bulk_load(dst, src + i * chunk, chunk, bar);
  });
}

// Tile t of the GEMM's B stream at 128 rows per expert: groups of 8 experts, N tile outer, expert
// inner (the engine's raster with group_m 8 and one M tile per expert); each tile walks its K blocks.
__global__ void tma_read(const __grid_constant__ CUtensorMap map, int experts, int n_tiles, int k_blocks,
                         int stages, unsigned* error, unsigned* sink) {
  const int64_t boxes = int64_t(experts) * n_tiles * k_blocks;
  ring_read(boxes, stages, 256u * 128u, error, sink, [&](int64_t i, void* dst, uint64_t* bar) {
    const int64_t tile = i / k_blocks;
    const int kb = int(i % k_blocks);
    const mok::sched::TileMN en = mok::sched::tile_raster(int32_t(tile), experts, n_tiles, 8);  // (m: the expert)
    sm90::tma_load_3d(dst, &map, bar, kb * 64, en.n * 256, en.m);
  });
}

__global__ void stg_write(uint4* __restrict__ dst, int64_t n16) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4 v = make_uint4(threadIdx.x, blockIdx.x, 0x5a5a5a5au, 0u);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride) dst[i] = v;
}

template <int kInflight>
__global__ void tma_store_write(const __grid_constant__ CUtensorMap map, int experts, int m_tiles, int n_tiles) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  if (threadIdx.x != 0) return;
  unsigned char* smem = smem_raw + ((1024u - (sm90::smem_addr(smem_raw) & 1023u)) & 1023u);  // (the swizzle's atom)
  const int64_t per_e = int64_t(m_tiles) * n_tiles, tiles = int64_t(experts) * per_e;
  int box = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int e = int(t / per_e);
    const mok::sched::TileMN mn = mok::sched::tile_raster(int32_t(t % per_e), m_tiles, n_tiles, 8);
    for (int half = 0; half < 2; ++half)
      for (int c = 0; c < 4; ++c) {
        sm90::tma_store_3d(&map, smem + size_t(box % (2 * kInflight)) * 8192, mn.n * 256 + c * 64,
                           mn.m * 128 + half * 64, e);
        sm90::tma_store_commit();
        sm90::tma_store_wait_read<kInflight>();
        ++box;
      }
  }
  sm90::tma_store_wait_all<0>();
}

struct Result {
  std::string kind, shape;
  double tbps = 0;
  bool write = false;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int reps = 20;
  double gib = 2.0;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--out" && i + 1 < argc) out_path = argv[++i];
      else if (a == "--reps" && i + 1 < argc) reps = mok::bench::parse_number("--reps", argv[++i], 3, 100000);
      else if (a == "--gib" && i + 1 < argc) gib = mok::bench::parse_number("--gib", argv[++i], 0.5, 64.0);
      else {
        std::fprintf(stderr, "usage: %s [--out read.json] [--reps N >= 3] [--gib G >= 0.5]\n", argv[0]);
        return 2;
      }
    }
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  // DeepSeek-V3 FC1 weights of 32 local experts: 32 x 4096 x 7168 bf16 = 1.88 GB; the flat readers
  // use a buffer of `gib` GiB (at least that size). Both are far above the 60 MB L2.
  const int experts = 32, n_rows = 4096, k = 7168;
  const size_t w_bytes = size_t(experts) * n_rows * k * 2;
  const size_t bytes = std::max(w_bytes, size_t(gib * double(1ull << 30))) / (1u << 20) * (1u << 20);
  void* buf = nullptr;
  unsigned* dev = nullptr;  // [0] sink, [1] error
  MOK_CUDA_CHECK(cudaMalloc(&buf, bytes));
  MOK_CUDA_CHECK(cudaMalloc(&dev, 2 * sizeof(unsigned)));
  MOK_CUDA_CHECK(cudaMemset(buf, 0x3c, bytes));
  MOK_CUDA_CHECK(cudaMemset(dev, 0, 2 * sizeof(unsigned)));
  cudaEvent_t e0, e1;
  MOK_CUDA_CHECK(cudaEventCreate(&e0));
  MOK_CUDA_CHECK(cudaEventCreate(&e1));

  std::vector<Result> results;
  // Median of `reps` single launches after 3 warm-ups, as TB/s of `read` bytes.
  auto time = [&](const std::string& kind, const std::string& shape, size_t read, auto launch, bool write = false) {
    for (int w = 0; w < 3; ++w) launch();
    std::vector<float> ms;
    for (int r = 0; r < reps; ++r) {
      MOK_CUDA_CHECK(cudaEventRecord(e0));
      launch();
      MOK_CUDA_CHECK(cudaEventRecord(e1));
      MOK_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      MOK_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    MOK_CUDA_CHECK(cudaGetLastError());
    unsigned err = 0;
    MOK_CUDA_CHECK(cudaMemcpy(&err, dev + 1, sizeof(err), cudaMemcpyDeviceToHost));
    if (err != 0) {
      std::fprintf(stderr, "mok_read_ceiling: %s %s: a wait timed out (site %u); no figure\n", kind.c_str(),
                   shape.c_str(), err);
      MOK_CUDA_CHECK(cudaMemset(dev + 1, 0, sizeof(unsigned)));
      return;
    }
    std::sort(ms.begin(), ms.end());
    const double tbps = double(read) / (double(ms[ms.size() / 2]) * 1e-3) / 1e12;
    results.push_back({kind, shape, tbps, write});
    std::printf("%-5s %-34s %6.3f TB/s  (median of %d, %.3f ms)\n", kind.c_str(), shape.c_str(), tbps, reps,
                ms[ms.size() / 2]);
  };

  const int64_t n16 = int64_t(bytes / 16);
  for (int per_sm : {2, 4, 8}) {
    for (int threads : {256, 512}) {
      const std::string shape = std::to_string(per_sm) + " CTAs/SM x " + std::to_string(threads) + " thr, ";
      time("ldg", shape + "4 loads", bytes, [&] {
        ldg_read<4><<<sms * per_sm, threads>>>(static_cast<const uint4*>(buf), n16, dev);
      });
      time("ldg", shape + "8 loads", bytes, [&] {
        ldg_read<8><<<sms * per_sm, threads>>>(static_cast<const uint4*>(buf), n16, dev);
      });
    }
  }
  for (uint32_t chunk : {16384u, 32768u}) {
    for (int stages : {4, 6}) {
      for (int per_sm : {1, 2}) {
        const size_t smem = size_t(chunk) * stages;
        if (smem * per_sm > size_t(prop.sharedMemPerMultiprocessor) - 4096) continue;
        MOK_CUDA_CHECK(cudaFuncSetAttribute(bulk_read, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        const int64_t chunks = int64_t(bytes / chunk);
        time("bulk", std::to_string(chunk / 1024) + " KB x " + std::to_string(stages) + " stages, " +
                         std::to_string(per_sm) + " CTA/SM",
             size_t(chunks) * chunk, [&] {
               bulk_read<<<sms * per_sm, 32, smem>>>(static_cast<const unsigned char*>(buf), chunks, chunk,
                                                     stages, dev + 1, dev);
             });
      }
    }
  }
  const CUtensorMap map = mok::gemm::make_map_3d(buf, experts, n_rows, k, 256);
  for (int stages : {4, 6}) {
    for (int per_sm : {1, 2}) {
      const size_t smem = size_t(32768) * stages;
      if (smem * per_sm > size_t(prop.sharedMemPerMultiprocessor) - 4096) continue;
      MOK_CUDA_CHECK(cudaFuncSetAttribute(tma_read, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      time("tma", "[32,4096,7168] 256x64 boxes, " + std::to_string(stages) + " stages, " +
                      std::to_string(per_sm) + " CTA/SM",
           w_bytes, [&] {
             tma_read<<<sms * per_sm, 32, smem>>>(map, experts, n_rows / 256, k / 64, stages, dev + 1, dev);
           });
    }
  }
  // Writers (the same median of `reps` launches; TB/s of bytes written).
  for (int per_sm : {1, 2, 4}) {
    for (int threads : {256, 512}) {
      time("stg", std::to_string(per_sm) + " CTAs/SM x " + std::to_string(threads) + " thr", bytes, [&] {
        stg_write<<<sms * per_sm, threads>>>(static_cast<uint4*>(buf), n16);
      }, true);
    }
  }
  time("memset", "cudaMemsetAsync", bytes, [&] { MOK_CUDA_CHECK(cudaMemsetAsync(buf, 0x3c, bytes)); }, true);
  const CUtensorMap dw_map = mok::gemm::make_map_3d(buf, experts, n_rows, k, 64);
  const auto tma_store = [&](auto kernel, int inflight) {
    for (int per_sm : {1, 2}) {
      const int smem = 2 * inflight * 8192 + 1024;
      MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      time("tma_store", "dW [32,4096,7168] 64x64 boxes, " + std::to_string(inflight) + " in flight, " +
                            std::to_string(per_sm) + " CTA/SM",
           w_bytes, [&] { kernel<<<sms * per_sm, 32, smem>>>(dw_map, experts, n_rows / 128, k / 256); }, true);
    }
  };
  tma_store(tma_store_write<1>, 1);
  tma_store(tma_store_write<4>, 4);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  const auto best_of = [&](bool write) {
    Result b;
    for (const Result& r : results)
      if (r.write == write && r.tbps > b.tbps) b = r;
    return b;
  };
  const Result best = best_of(false), best_w = best_of(true);
  if (best.tbps <= 0 || best_w.tbps <= 0) {
    std::fprintf(stderr, "mok_read_ceiling: no reader or no writer finished\n");
    return 1;
  }
  std::printf("read ceiling: %.3f TB/s (%s %s), %s, %d SMs\n", best.tbps, best.kind.c_str(), best.shape.c_str(),
              prop.name, sms);
  std::printf("write ceiling: %.3f TB/s (%s %s)\n", best_w.tbps, best_w.kind.c_str(), best_w.shape.c_str());
  if (!out_path.empty()) {
    FILE* f = std::fopen(out_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "mok_read_ceiling: cannot write %s\n", out_path.c_str());
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"read_tbps\": %.4f, \"best\": \"%s %s\", \"write_tbps\": %.4f, "
                 "\"best_write\": \"%s %s\", \"bytes\": %zu",
                 prop.name, best.tbps, best.kind.c_str(), best.shape.c_str(), best_w.tbps, best_w.kind.c_str(),
                 best_w.shape.c_str(), bytes);
    for (bool write : {false, true}) {
      std::fprintf(f, ", \"%s\": [\n", write ? "writers" : "readers");
      bool first = true;
      for (const Result& r : results) {
        if (r.write != write) continue;
        std::fprintf(f, "%s  {\"kind\": \"%s\", \"shape\": \"%s\", \"tbps\": %.4f}", first ? "" : ",\n",
                     r.kind.c_str(), r.shape.c_str(), r.tbps);
        first = false;
      }
      std::fprintf(f, "\n]");
    }
    std::fprintf(f, "}\n");
    std::fclose(f);
  }
  cudaFree(buf);
  cudaFree(dev);
  return 0;
}
