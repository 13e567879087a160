// mok — deterministic random device data for benchmarks and tests at model shapes (where host
// generation and upload of tens of GB would dominate). Same (seed, index) -> same value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gpu {

// p[i] = bf16(scale * z_i), z_i approximately standard normal (Irwin–Hall of 4 uniforms).
void fill_normal_bf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace mok::gpu
