#include <cuda_bf16.h>

#include "common/cuda_check.h"
#include "common/device_fill.h"

namespace mok::gpu {

namespace {

__device__ __forceinline__ uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t r = splitmix(seed * 0x100000001B3ull + static_cast<uint64_t>(i));
    const float s = static_cast<float>(r & 0xffff) + static_cast<float>((r >> 16) & 0xffff) +
                    static_cast<float>((r >> 32) & 0xffff) + static_cast<float>(r >> 48);
    const float z = (s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
    p[i] = __float2bfloat16_rn(z * scale);
  }
}

}  // namespace

void fill_normal_bf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  fill_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gpu
