// mok — one routed row copied by one warp with 16-byte accesses, four in flight per lane. Used by
// the unfused movement kernels (dispatch.cu); the megakernel's comm CTAs move rows with bulk
// copies through shared memory instead (forward_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gpu {

__device__ __forceinline__ void copy_row(const uint4* __restrict__ from, uint4* __restrict__ to, int vecs,
                                         int lane) {
  int v = lane;
  for (; v + 96 < vecs; v += 128) {
    const uint4 a = from[v], b = from[v + 32], c = from[v + 64], d = from[v + 96];
    to[v] = a;
    to[v + 32] = b;
    to[v + 64] = c;
    to[v + 96] = d;
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

// The warps of all CTAs striding over the routed rows [row_begin, min(row_end, total_rows)) of a
// window (row_end < 0: to the end): fn(row, lane) once per row, all 32 lanes of a warp together.
// Stops once `abort` is set (checked every 16 rows of a warp): after a failure no row moves to or
// from a peer.
template <typename Schedule, typename Fn>
__device__ __forceinline__ void for_each_window_row(const Schedule& s, int64_t row_begin, int64_t row_end,
                                                    const uint32_t* abort, Fn&& fn) {
  const int64_t total = s.totals->total_rows;
  const int64_t end = row_end < 0 || row_end > total ? total : row_end;
  const int lane = threadIdx.x & 31;
  const int warps = static_cast<int>((gridDim.x * blockDim.x) >> 5);
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  int n = 0;
  for (int64_t row = row_begin + warp; row < end; row += warps) {
    if ((n++ & 15) == 0 && abort_seen(abort)) return;
    fn(row, lane);
  }
}

}  // namespace mok::gpu
