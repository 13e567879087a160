// mok — host helper: the address at which kernels on `device` reach `peer`'s part of window `w`
// at `offset` (NCCL's flat alias; NCCL 2.28 has no host-side getter, so one tiny kernel on
// `stream` computes it, synchronously). Kernels must reach windows only through these aliases
// (see comm/device.cuh); hand them to kernels that should not carry a window handle.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>

namespace mok::comm {

void* flat_alias(ncclWindow_t w, size_t offset, int peer, int device, cudaStream_t stream);

// Host helper: writes `code` into every peer's abort word (the first 4 bytes of `abort_win`)
// unless the peer holds one already, with one tiny kernel on `stream`, synchronously. Used when the
// host finds a failure that only this GPU saw and no barrier of this rank will run any more to
// pass it on (comm/abort_word.h).
void tell_peers(ncclWindow_t abort_win, int rank, int nranks, uint32_t code, int device, cudaStream_t stream);

}  // namespace mok::comm
