// mok — the abort word: how one rank's failure becomes every rank's failure.
//
// Each rank owns one 32-bit word in a small symmetric window of its communicator. Zero means
// healthy. The first failure on a GPU writes a nonzero code there (atomicCAS: the first one wins),
// and a failing comm wait also writes its code into every peer's word (system-scope CAS over
// NVLink), so that the peers' waits give up at once instead of running into their own deadlines,
// and their later kernels return at entry instead of merging data nobody delivered. The layer's
// barrier kernel forwards a failure that only this GPU saw (a kernel-internal pipeline wait) the
// same way before it refuses to arrive.
//
// Codes: a kernel-internal pipeline site (the GEMM engine's and the megakernel's kSite* values,
// all below 2^16) is written as is; a comm wait's failure is encoded with the rank it happened on:
//   bit 31 set | (origin rank & 0x7fff) << 16 | (wait id or site & 0xffff).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_ABORT_HD __host__ __device__ __forceinline__
#else
#define MOK_ABORT_HD inline
#endif

namespace mok::comm {

MOK_ABORT_HD uint32_t encode_abort(int origin_rank, uint32_t id) {
  return 0x80000000u | ((static_cast<uint32_t>(origin_rank) & 0x7fffu) << 16) | (id & 0xffffu);
}
MOK_ABORT_HD bool abort_has_origin(uint32_t code) { return (code & 0x80000000u) != 0u; }
// The rank whose failure the code stands for; `self` for a bare pipeline site.
MOK_ABORT_HD int abort_origin(uint32_t code, int self) {
  return abort_has_origin(code) ? static_cast<int>((code >> 16) & 0x7fffu) : self;
}
MOK_ABORT_HD uint32_t abort_id(uint32_t code) { return code & 0xffffu; }

}  // namespace mok::comm
