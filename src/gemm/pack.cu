// mok — gate/up weight packing on the device (see grouped_gemm.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/grouped_gemm.h"
#include "mok/errors.hpp"

namespace mok::gemm {
namespace {

// One thread per 16-byte unit of an output row.
__global__ void pack_gate_up_kernel(const uint4* __restrict__ gate, const uint4* __restrict__ up,
                                    uint4* __restrict__ out, int64_t rows_out, int64_t units_per_row) {
  const int64_t total = rows_out * units_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / units_per_row, unit = i - row * units_per_row;
    // row = e * 2I + 16j + s*8 + r  ->  source row e * I + 8j + r of gate (s = 0) or up (s = 1)
    const int64_t r16 = row % 16, base = row - r16;  // base = e*2I + 16j
    const int64_t src_row = base / 2 + (r16 % 8);
    const uint4* src = r16 < 8 ? gate : up;
    out[i] = src[src_row * units_per_row + unit];
  }
}

// The inverse: one thread per 16-byte unit of a packed row, written to its gate or up row.
__global__ void unpack_gate_up_kernel(const uint4* __restrict__ packed, uint4* __restrict__ gate,
                                      uint4* __restrict__ up, int64_t rows_in, int64_t units_per_row) {
  const int64_t total = rows_in * units_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / units_per_row, unit = i - row * units_per_row;
    const int64_t r16 = row % 16, base = row - r16;
    const int64_t dst_row = base / 2 + (r16 % 8);
    (r16 < 8 ? gate : up)[dst_row * units_per_row + unit] = packed[i];
  }
}

int grid_for(int64_t total) { return static_cast<int>(std::min<int64_t>((total + 255) / 256, 65536)); }

void check_dims(const char* what, int64_t inter, int64_t hidden) {
  MOK_REQUIRE(inter % 8 == 0, ::mok::detail::concat(what, ".inter"), "multiple of 8, got ", inter);
  MOK_REQUIRE(hidden % 8 == 0, ::mok::detail::concat(what, ".hidden"), "multiple of 8, got ", hidden);
}

}  // namespace

void unpack_gate_up(const void* w1p, void* w_gate, void* w_up, int64_t experts, int64_t inter, int64_t hidden,
                    cudaStream_t stream) {
  check_dims("unpack_gate_up", inter, hidden);
  const int64_t rows_in = experts * 2 * inter, units = hidden / 8;
  if (rows_in == 0 || units == 0) return;
  unpack_gate_up_kernel<<<grid_for(rows_in * units), 256, 0, stream>>>(
      static_cast<const uint4*>(w1p), static_cast<uint4*>(w_gate), static_cast<uint4*>(w_up), rows_in, units);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void pack_gate_up(const void* w_gate, const void* w_up, void* w1p, int64_t experts, int64_t inter,
                  int64_t hidden, cudaStream_t stream) {
  check_dims("pack_gate_up", inter, hidden);
  const int64_t rows_out = experts * 2 * inter, units = hidden / 8;
  if (rows_out == 0 || units == 0) return;
  pack_gate_up_kernel<<<grid_for(rows_out * units), 256, 0, stream>>>(static_cast<const uint4*>(w_gate),
                                                   static_cast<const uint4*>(w_up),
                                                   static_cast<uint4*>(w1p), rows_out, units);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
