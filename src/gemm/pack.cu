// mok — gate/up weight packing on the device (see mok/gemm.hpp).
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"

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

}  // namespace

void pack_gate_up(const void* w_gate, const void* w_up, void* w1p, int64_t experts, int64_t inter,
                  int64_t hidden, cudaStream_t stream) {
  MOK_REQUIRE(inter % 8 == 0, "pack_gate_up.inter", "multiple of 8, got ", inter);
  MOK_REQUIRE(hidden % 8 == 0, "pack_gate_up.hidden", "multiple of 8, got ", hidden);
  const int64_t rows_out = experts * 2 * inter, units = hidden / 8;
  if (rows_out == 0 || units == 0) return;
  const int64_t total = rows_out * units;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65536));
  pack_gate_up_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(w_gate),
                                                   static_cast<const uint4*>(w_up),
                                                   static_cast<uint4*>(w1p), rows_out, units);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gemm
