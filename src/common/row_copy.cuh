// mok — one row copied by one warp with 16-byte accesses, four (or two) in flight per lane, and
// the abort word's check: shared by the movement kernels (src/megakernel/move_row.cuh) and the
// GEMM engine's idle producer warps (grouped_kernel.cuh's row pull), which move routed rows
// beside a GEMM's MMAs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gpu {

// kInFlight (4 or 2) vectors a lane in flight: 2 where registers are scarce (a GEMM's producer
// warps after setmaxnreg, grouped_kernel.cuh).
template <int kInFlight = 4>
__device__ __forceinline__ void copy_row(const uint4* __restrict__ from, uint4* __restrict__ to, int vecs,
                                         int lane) {
  static_assert(kInFlight == 4 || kInFlight == 2, "four or two vectors in flight");
  int v = lane;
  if constexpr (kInFlight == 4) {
    for (; v + 96 < vecs; v += 128) {
      const uint4 a = from[v], b = from[v + 32], c = from[v + 64], d = from[v + 96];
      to[v] = a;
      to[v + 32] = b;
      to[v + 64] = c;
      to[v + 96] = d;
    }
  } else {
    for (; v + 32 < vecs; v += 64) {
      const uint4 a = from[v], b = from[v + 32];
      to[v] = a;
      to[v + 32] = b;
    }
  }
  for (; v < vecs; v += 32) to[v] = from[v];
}

__device__ __forceinline__ void zero_row(uint4* to, int vecs, int lane) {
  for (int v = lane; v < vecs; v += 32) to[v] = make_uint4(0u, 0u, 0u, 0u);
}

// True once the communicator's abort word (may be null) is nonzero: some rank failed.
__device__ __forceinline__ bool abort_seen(const uint32_t* abort) {
  if (abort == nullptr) return false;
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(abort) : "memory");  // peers write it
  return v != 0u;
}

}  // namespace mok::gpu
