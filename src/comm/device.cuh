// mok — the device side of the communication layer, in one header.
//
// Everything a kernel does to another GPU goes through here: peer pointers into symmetric windows,
// system-scope release/acquire flags and counters, bounded spin-waits, and the LSA barrier. A later
// multi-node backend (NCCL GIN) replaces this file, not the kernels.
//
// Usage:
//   host:   auto dc = mok::comm::dev::make_device_comm(communicator);
//           kernel<<<...>>>(dc, ...);                       // by value, 256 bytes
//   device: __global__ void kernel(__grid_constant__ const mok::comm::dev::DeviceComm dc, ...)
//           (__grid_constant__ keeps the struct in parameter space: no local copy, no stack frame.)
//
// Memory model (PTX, system scope, because the other side is another GPU):
//   * Data written to a peer, then a flag: the writer's stores, then store_release/add_release on
//     the flag (st/red .release.sys). Bulk-async (TMA) stores: wait for their completion
//     (cp.async.bulk.wait_group 0, not .read) and fence_proxy_async() before the release.
//   * The reader: wait_geq (ld.acquire.sys) then reads the data. Reads by TMA after the wait:
//     fence_proxy_async() first.
//   * Access a window inside kernels only through local_ptr/peer_ptr (NCCL's flat aliases), not
//     through the host-side Window::ptr: two virtual aliases of one location are not ordered with
//     each other by release/acquire (PTX "proxy" rule). Kernel boundaries order everything.
//
// Bounded waits: every wait has a deadline (Config::wait_timeout_s, read from %globaltimer). On
// expiry the first waiter on this GPU claims the abort word (comm/abort_word.h), writes its code
// into every peer's abort word too, fills the WaitErrorRecord (wait id, rank, peer, values) in
// host-mapped memory, and the wait returns false; every other wait on any rank sees a nonzero
// abort word and also returns false. Kernels must then return (never trap: a trap kills the CUDA
// context and with it any chance of a clean teardown); kernels that touch peer memory or merge
// what peers delivered check the word at entry (entry_aborted). The host's
// Communicator::check_waits() raises mok::Error(ErrorKind::Timeout, "<wait name>") naming the rank
// whose wait expired, on that rank and on the peers it told.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "comm/abort_word.h"
#include "comm/flat_alias.h"
#include "common/device_clock.cuh"
#include "common/cuda_check.h"
#include "mok/comm.hpp"

namespace mok::comm::dev {

struct DeviceComm {
  ncclDevComm nccl;        // by value; LSA team == world on one node
  WaitErrorRecord* error;  // host-mapped
  uint32_t* claim;         // this rank's abort word (flat alias); nonzero once any rank failed
  ncclWindow_t abort_win;  // the abort words' window: peers' words at ncclGetLsaPointer(abort_win, 0, p)
  uint32_t* record_claim;  // device memory: the record above is written once
  uint64_t timeout_ns;
  int rank;
  int nranks;
};

// Host: the kernel argument for `c`.
inline DeviceComm make_device_comm(const Communicator& c) {
  DeviceComm d{};
  d.nccl = c.dev_comm();
  d.error = c.wait_error_device();
  d.claim = c.wait_claim_device();
  d.abort_win = c.abort_window();
  d.record_claim = c.record_claim_device();
  d.timeout_ns = c.wait_timeout_ns();
  d.rank = c.rank();
  d.nranks = c.world_size();
  return d;
}

#if defined(__CUDACC__)

// ---------------------------------------------------------------------------------------------
// Pointers. `peer` is a rank of the communicator (== LSA rank on one node, checked at creation).
// ---------------------------------------------------------------------------------------------
template <typename T = void>
__device__ __forceinline__ T* peer_ptr(ncclWindow_t w, size_t offset, int peer) {
  return static_cast<T*>(ncclGetLsaPointer(w, offset, peer));
}
template <typename T = void>
__device__ __forceinline__ T* local_ptr(ncclWindow_t w, size_t offset) {
  return static_cast<T*>(ncclGetLocalPointer(w, offset));
}

// ---------------------------------------------------------------------------------------------
// Flags and counters (32-bit, system scope).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_relaxed(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Full system-scope fence (orders everything before against everything after).
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Between generic-proxy flags and async-proxy (TMA / bulk copy) accesses of global memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
using mok::globaltimer_ns;  // common/device_clock.cuh

// ---------------------------------------------------------------------------------------------
// Bounded waits.
// ---------------------------------------------------------------------------------------------
// True once some wait on this GPU has expired (then every other wait gives up too).
// System scope: peers write the word with system-scope atomics over NVLink.
__device__ __forceinline__ bool wait_aborted(const DeviceComm& c) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(c.claim) : "memory");
  return v != 0;
}

__device__ __forceinline__ uint32_t abort_code(const DeviceComm& c) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(c.claim) : "memory");
  return v;
}

// Writes `code` into every peer's abort word unless the peer already holds one (its own failure
// or an earlier notice: the first code wins there too).
__device__ __noinline__ inline void broadcast_abort(const DeviceComm& c, uint32_t code) {
  if (c.abort_win == nullptr) return;
  for (int p = 0; p < c.nranks; ++p) {
    if (p == c.rank) continue;
    atomicCAS_system(static_cast<unsigned int*>(ncclGetLsaPointer(c.abort_win, 0, p)), 0u, code);
  }
  __threadfence_system();
}

// Fills the host-mapped record (once per GPU: the first writer wins).
__device__ __noinline__ inline void write_record(const DeviceComm& c, uint32_t wait_id, int origin, int peer,
                                                 uint64_t expected, uint64_t observed, uint64_t waited_ns) {
  if (c.record_claim == nullptr || atomicCAS(c.record_claim, 0u, 1u) != 0u) return;
  volatile WaitErrorRecord* r = c.error;
  r->status = 1u;
  r->wait_id = wait_id;
  r->rank = c.rank;
  r->origin = origin;
  r->peer = peer;
  r->block = blockIdx.x;
  r->thread = threadIdx.x;
  r->expected = expected;
  r->observed = observed;
  r->waited_ns = waited_ns;
  __threadfence_system();
  r->status = 2u;
  __threadfence_system();
}

// Records an expired wait: the abort word (first failure on this GPU wins), the peers' abort
// words, and the host-mapped record.
__device__ __noinline__ inline void report_timeout(const DeviceComm& c, uint32_t wait_id, int peer,
                                                   uint64_t expected, uint64_t observed,
                                                   uint64_t waited_ns) {
  const uint32_t code = encode_abort(c.rank, wait_id);
  if (atomicCAS_system(c.claim, 0u, code) != 0u) return;
  broadcast_abort(c, code);
  write_record(c, wait_id, c.rank, peer, expected, observed, waited_ns);
}

// A peer's failure seen here for the first time: recorded in the host-mapped record, so the host
// can refuse the next call without reading device memory. Own failures record themselves.
__device__ __noinline__ inline void note_abort(const DeviceComm& c) {
  const uint32_t code = abort_code(c);
  if (code == 0u || abort_origin(code, c.rank) == c.rank) return;
  if (*reinterpret_cast<volatile uint32_t*>(c.record_claim) != 0u) return;
  write_record(c, abort_id(code), abort_origin(code, c.rank), -1, 0, 0, 0);
}

// Kernels that touch peer memory, or merge what peers delivered, start with this (all threads of
// the block call it; block-uniform result): true when some rank has failed, and the kernel must
// return. Notes a peer's failure in the record.
__device__ __forceinline__ bool entry_aborted(const DeviceComm& c) {
  int aborted = 0;
  if (threadIdx.x == 0) {
    aborted = abort_code(c) != 0u ? 1 : 0;
    if (aborted) note_abort(c);
  }
  return __syncthreads_or(aborted) != 0;
}

// Spins (this thread) until the 32-bit value at `p` has reached `target` in wrap-around order,
// i.e. (int32_t)(*p - target) >= 0, with acquire semantics at system scope. Returns false when the
// deadline passes (the record is written) or another wait on this GPU already expired.
__device__ __forceinline__ bool wait_geq(const DeviceComm& c, const uint32_t* p, uint32_t target,
                                         uint32_t wait_id, int peer) {
  uint32_t v = load_acquire(p);
  if (static_cast<int32_t>(v - target) >= 0) return true;
  const uint64_t start = globaltimer_ns();
#pragma unroll 1
  for (uint32_t spins = 1;; ++spins) {
    v = load_acquire(p);
    if (static_cast<int32_t>(v - target) >= 0) return true;
    if ((spins & 63u) == 0u) {
      const uint64_t waited = globaltimer_ns() - start;
      if (waited > c.timeout_ns) {
        report_timeout(c, wait_id, peer, target, v, waited);
        return false;
      }
      if (wait_aborted(c)) {
        note_abort(c);
        return false;
      }
    }
  }
}

// CTA-wide: thread 0 waits, every thread of the block gets the result (and the acquire is ordered
// before the rest of the block by the barrier). All threads of the block must call it.
__device__ __forceinline__ bool cta_wait_geq(const DeviceComm& c, const uint32_t* p, uint32_t target,
                                             uint32_t wait_id, int peer) {
  int ok = 1;
  if (threadIdx.x == 0) ok = wait_geq(c, p, target, wait_id, peer) ? 1 : 0;
  return __syncthreads_and(ok) != 0;
}

// ---------------------------------------------------------------------------------------------
// LSA barrier across all ranks, for one CTA (all its threads call it). Bounded.
// `index` < CommOptions::lsa_barrier_count and no two CTAs may use one index concurrently.
// Orders (release before arrive, acquire after wait, system scope) everything the block did
// before against everything any rank's block does after. Returns false on timeout/abort.
// Built on NCCL's ncclLsaBarrierSession (its arrive and its epoch/inbox state), with mok's bounded
// wait in place of NCCL's unbounded one.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ bool lsa_barrier(const DeviceComm& c, uint32_t index,
                                            uint32_t wait_id = kWaitLsaBarrier) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), c.nccl, ncclTeamTagLsa(), index};
  bar.arrive(ncclCoopCta(), cuda::memory_order_release);
  int ok = 1;
  const int n = bar.team.nRanks;
#pragma unroll 1
  for (int i = threadIdx.x; i < n - 1; i += blockDim.x) {
    const int peer = i + (bar.team.rank <= i ? 1 : 0);
    const uint32_t* inbox = bar.ucInbox(bar.team.rank, peer);
    if (!wait_geq(c, inbox, bar.epoch + 1u, wait_id, peer)) ok = 0;
  }
  bar.epoch += 1u;  // NCCL's destructor stores it back for the next session on this index
  return __syncthreads_and(ok) != 0;
}

// ---------------------------------------------------------------------------------------------
// Host helper: the address at which kernels on `c`'s device reach `peer`'s part of window `w`
// (NCCL's flat alias; NCCL 2.28 has no host-side getter, so one tiny kernel computes it). Use it
// to hand raw peer pointers to kernels that should not carry a window handle.
// ---------------------------------------------------------------------------------------------
inline void* lsa_pointer(const Communicator& c, const Window& w, int peer, size_t offset = 0) {
  MOK_REQUIRE(peer >= 0 && peer < c.world_size(), "peer", "must be a rank in [0, ", c.world_size(),
              "), got ", peer);
  MOK_REQUIRE(offset < w.bytes, "offset", "must be inside window '", w.name, "' (", w.bytes,
              " bytes), got ", offset);
  return flat_alias(w.handle, offset, peer, c.device(), c.stream());
}

#endif  // __CUDACC__

}  // namespace mok::comm::dev
