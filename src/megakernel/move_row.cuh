// mok — the window's routed rows walked by the warps of a movement kernel (dispatch.cu, reverse.cu),
// each row copied by one warp (common/row_copy.cuh); the megakernel's comm CTAs move rows with bulk
// copies through shared memory instead (forward_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/row_copy.cuh"

namespace mok::gpu {

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
