// mok — host helper: the address at which kernels on `device` reach `peer`'s part of window `w`
// at `offset` (NCCL's flat alias; NCCL 2.28 has no host-side getter, so one tiny kernel on
// `stream` computes it, synchronously). Kernels must reach windows only through these aliases
// (see comm/device.cuh); hand them to kernels that should not carry a window handle.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>

namespace mok::comm {

void* flat_alias(ncclWindow_t w, size_t offset, int peer, int device, cudaStream_t stream);

}  // namespace mok::comm
