// mok — one routed row copied by one warp with 16-byte accesses, four in flight per lane. Used by
// the unfused movement kernels (dispatch.cu); the megakernel's comm CTAs move rows with bulk
// copies through shared memory instead (forward_kernel.cu).
#pragma once

#include <cuda_runtime.h>

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

}  // namespace mok::gpu
