// mok — the megakernel runtime's device pieces, shared by its programs (the forward today; the
// backward program will use the same): local dependency counters with gpu-scope release/acquire,
// the bounded counter wait (system scope when other GPUs advance the counter), the per-CTA
// profile clock, and the bounded producer <-> consumer hand-off wait of the task ring. Every
// wait is bounded by the communicator's deadline (comm/device.cuh) and gives up once any rank
// has failed.
#pragma once

#include <cstdint>

#include "comm/device.cuh"
#include "gemm/sm90.cuh"

namespace mok::mk::rt {

namespace dev = mok::comm::dev;
using gemm::sm90::WaitBound;
using gemm::sm90::global_timer_ns;
using gemm::sm90::mbar_try_wait;
using gemm::sm90::mbar_try_wait_cluster;

// Recorded in the abort word when a task hand-off wait outlives its own bound.
inline constexpr unsigned int kSiteTaskSlot = 0x6e10;

// Local (same GPU) counters: gpu-scope release/acquire.
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Bounded wait for a local counter (one thread). False when it expired or another wait did.
// `sys`: the counter is also advanced by other GPUs (push dispatch), acquire at system scope.
__device__ __forceinline__ bool wait_counter(const dev::DeviceComm& dc, const uint32_t* p, uint32_t target,
                                             uint32_t wait_id, bool sys = false) {
  const auto load = [&] { return sys ? dev::load_acquire(p) : ld_acquire(p); };
  if (load() >= target) return true;
  const uint64_t start = dev::globaltimer_ns();
#pragma unroll 1
  for (uint32_t spins = 1;; ++spins) {
    const uint32_t v = load();
    if (v >= target) return true;
    if ((spins & 63u) == 0u) {
      const uint64_t waited = dev::globaltimer_ns() - start;
      if (waited > dc.timeout_ns) {
        dev::report_timeout(dc, wait_id, -1, target, v, waited);
        return false;
      }
      if (dev::wait_aborted(dc)) return false;
    }
  }
}

// Optional profile (params.stats != nullptr): kWords words per CTA, written once at the end.
// Compute CTAs: span, busy (consumer warpgroup 0: tile MMAs + epilogues), waiting for a task
// (consumer warpgroup 0), dependency waits (producer), tiles, then (consumer warpgroup 0) the wait
// from holding a task to its first stage's MMAs, epilogues, FC2 busy time, FC2 tiles, tiles whose
// B was multicast (clusters), SM cycles over the span (clock64: the average SM clock is word 10 /
// word 0). Comm CTAs: span, pulling, pushing, waiting for work, 0.
template <int kWords>
struct StatClock {
  unsigned long long* out;
  uint64_t t0;
  __device__ __forceinline__ explicit StatClock(unsigned long long* stats)
      : out(stats ? stats + size_t(blockIdx.x) * kWords : nullptr), t0(out ? dev::globaltimer_ns() : 0) {}
  __device__ __forceinline__ uint64_t now() const { return out ? dev::globaltimer_ns() : 0; }
};

// Waits of the producer <-> consumer task hand-off. They do not give up when another wait on the
// GPU expired (unlike mbar_wait): the producer always fills the slot, with END at worst, within
// its own bounded waits, and the consumers always release slots within theirs, so these waits
// are bounded through the others. Giving up early here would make the consumers end while the
// producer still fills slots. The own bound (8 x the deadline) only catches a broken invariant;
// false = expired. A consumer warpgroup agrees on its threads' verdicts with a barrier-and (see
// consumer()), so not even this bound can split a warpgroup; the two warpgroups may disagree,
// which nothing hangs on: in a forward tile they meet only at stage barriers (bounded waits).
// kCluster: the slot may have been written by the other CTA of the cluster (acquire.cluster).
template <bool kCluster = false>
__device__ __forceinline__ bool handoff_wait(uint64_t* bar, uint32_t parity, const WaitBound& wb) {
  const auto ready = [&] { return kCluster ? mbar_try_wait_cluster(bar, parity) : mbar_try_wait(bar, parity); };
  if (ready()) return true;
  const uint64_t t0 = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    if (ready()) return true;
    if ((spins & 255u) == 0 && global_timer_ns() - t0 > 8 * wb.limit_ns) {
      atomicCAS(wb.error, 0u, kSiteTaskSlot);
      return false;
    }
  }
}

}  // namespace mok::mk::rt
