// mok — the one reader of the GPU's global nanosecond timer (%globaltimer): every bounded wait
// (comm/device.cuh, the GEMM engine's mbarrier waits in gemm/sm90.cuh, the megakernel runtime)
// and every profile clock measures its deadline with it.
#pragma once

#include <cstdint>

namespace mok {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace mok
