// mok — the device error word: how a kernel reports a problem without trapping.
//
// A kernel that finds bad input records the first problem in one 64-bit word and carries on;
// nothing traps, so the CUDA context stays usable. (Expired waits have their own, richer record
// in the communication layer: comm::WaitErrorRecord.) The host reads the word at its next check (after a synchronization it
// does anyway) and raises a mok::Error that names the problem. The word lives in host-mapped
// memory, so reading it needs no copy.
//
// Encoding: bits 56..63 code, 48..55 rank (the reporting rank), 0..47 detail (code-specific).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_ERR_HD __host__ __device__ __forceinline__
#else
#define MOK_ERR_HD inline
#endif

namespace mok {

enum class DeviceErrorCode : uint32_t {
  None = 0,
  InvalidExpertId = 1,      // detail: flat index t*k + j of the offending topk_idx entry
  InvalidRouterWeight = 2,  // detail: flat index of a routed slot whose topk_w is NaN, Inf or < 0
  RoutingChanged = 3,       // detail: flat index where backward()'s topk_idx differs from forward()'s
  ForwardIdDiffers = 4,     // detail: peer rank << 40 | its backward's forward id (low 40 bits): a peer
                            // ran another forward's backward, or another layer's
};

MOK_ERR_HD uint64_t encode_device_error(DeviceErrorCode code, int rank, uint64_t detail) {
  return (static_cast<uint64_t>(code) << 56) | (static_cast<uint64_t>(rank & 0xff) << 48) |
         (detail & 0xffffffffffffull);
}
MOK_ERR_HD DeviceErrorCode device_error_code(uint64_t w) { return static_cast<DeviceErrorCode>(w >> 56); }
MOK_ERR_HD int device_error_rank(uint64_t w) { return static_cast<int>((w >> 48) & 0xff); }
MOK_ERR_HD uint64_t device_error_detail(uint64_t w) { return w & 0xffffffffffffull; }

#if defined(__CUDACC__)
// Records `code` unless an earlier problem was recorded already (the first one wins).
__device__ __forceinline__ void report_device_error(unsigned long long* word, DeviceErrorCode code,
                                                    int rank, uint64_t detail) {
  if (word != nullptr) atomicCAS(word, 0ull, encode_device_error(code, rank, detail));
}
#endif

}  // namespace mok
