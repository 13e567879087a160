// mok — the megakernel runtime's device pieces, shared by its programs (the forward today; the
// backward program will use the same): local dependency counters with gpu-scope release/acquire,
// the bounded counter wait (system scope when other GPUs advance the counter), the per-CTA
// profile clock, the task ring a compute CTA's producer thread hands tasks to its consumer
// warpgroups through (a program's slot type in shared memory, with its cursors) and the ring's
// bounded hand-off wait. Every wait is bounded by the communicator's deadline (comm/device.cuh)
// and gives up once any rank has failed.
#pragma once

#include <cstdint>

#include "comm/device.cuh"
#include "gemm/engine_mainloop.cuh"
#include "gemm/sm90.cuh"

namespace mok::mk::rt {

namespace dev = mok::comm::dev;
using gemm::sm90::WaitBound;
using gemm::sm90::global_timer_ns;
using gemm::sm90::mbar_try_wait;
using gemm::sm90::mbar_try_wait_cluster;

// Recorded in the abort word when a task hand-off wait outlives its own bound.
inline constexpr unsigned int kSiteTaskSlot = 0x6e10;
// Wait id of a compute CTA's dependency waits, every program's (the layer names it
// "megakernel.task_dependency").
inline constexpr uint32_t kWaitTaskDeps = comm::kWaitUserBase + 40;

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

// A consumer thread's place in a compute CTA: its warpgroup (0 or 1: rows 0..63 or 64..127 of a
// tile), its thread in the warpgroup, its thread among both, and whether it leads its warpgroup.
struct ConsumerThread {
  int cwg;
  uint32_t wt, ct;
  bool leader;
  __device__ __forceinline__ ConsumerThread()
      : cwg(int(threadIdx.x / 128u) - 1), wt(threadIdx.x % 128u), ct(threadIdx.x - 128u), leader(threadIdx.x % 128u == 0) {}
};

// The task ring: kSlots slots of a program's task type (Slot, a multiple of 16 bytes), each with
// a full barrier (the producer's one arrival, a release of the slot's contents) and an empty one
// (the consumers' arrivals), laid out at an 8-byte aligned place of shared memory: the slots, the
// full barriers, the empty barriers (kBytes in all).
template <class Slot, int kSlots>
struct TaskRing {
  static_assert(sizeof(Slot) % 16 == 0, "slots are copied in 16-byte pieces");
  static constexpr int kCount = kSlots;
  static constexpr int kBytes = kSlots * int(sizeof(Slot)) + 2 * kSlots * 8;
  Slot* slot;
  uint64_t* full;   // [kSlots]
  uint64_t* empty;  // [kSlots]
  __device__ __forceinline__ static TaskRing at(uint8_t* p) {
    TaskRing r;
    r.slot = reinterpret_cast<Slot*>(p);
    r.full = reinterpret_cast<uint64_t*>(p + kSlots * sizeof(Slot));
    r.empty = r.full + kSlots;
    return r;
  }
};

// Position of the producer (or of the consumers) in a ring of kSlots: slot and barrier phase.
template <int kSlots>
struct SlotCursor {
  uint32_t i = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++i == uint32_t(kSlots)) {
      i = 0;
      phase ^= 1u;
    }
  }
};

// The same position as one count: slot n % kSlots, phase (n / kSlots) & 1, in one register, or
// (kInSmem) in a shared-memory word of the thread's own (`word`: no other thread touches it, so no
// barrier), for a program whose every register is taken across its mainloop: ptxas would spill
// the count to local memory there (the same traffic, a load and a store per task), which the
// build refuses. A launch takes far fewer than 2^32 tasks.
template <int kSlots, bool kInSmem = false>
struct SlotCount {
  uint32_t n = 0;
  volatile uint32_t* word = nullptr;  // kInSmem: this thread's word, zeroed by init()
  __device__ __forceinline__ void init(volatile uint32_t* w) {
    if constexpr (kInSmem) {
      word = w;
      *word = 0u;
    }
  }
  __device__ __forceinline__ uint32_t count() const {
    if constexpr (kInSmem) return *word;
    return n;
  }
  __device__ __forceinline__ uint32_t i() const { return count() % uint32_t(kSlots); }
  __device__ __forceinline__ uint32_t phase() const { return (count() / uint32_t(kSlots)) & 1u; }
  __device__ __forceinline__ void advance() {
    if constexpr (kInSmem)
      *word = *word + 1u;
    else
      ++n;
  }
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

// A megakernel CTA's start and role split (one CTA of 384 threads per SM, all resident), the
// program's parts given as callables:
//   * blockIdx.x < comm_ctas: `comm()` (all threads) unless a wait of an earlier kernel on this GPU
//     expired (the communicator is poisoned: nothing runs);
//   * otherwise a compute CTA: thread 0 initialises the engine's stage barriers, the task ring's
//     (full: 1 arrival; empty: 256 consumer threads) and `links` more barriers of 1 arrival each
//     (the forward's cluster hand-off through global slots), then
//     warpgroup 0 drops to kProducerRegs registers and one thread of its first warp runs
//     `producer()` (`follower()` on a cluster's rank 1), and the consumer warpgroups rise to
//     kConsumerRegs and run `consumer()`. With 2-CTA clusters the pair decides together (rank 0
//     reads the abort flag and writes it into both CTAs' `abort_word` between two cluster
//     barriers) whether to stop at once, so neither CTA leaves while the other could still write
//     into its shared memory, and both wait for each other at the end.
template <class C, int kSlots, bool kCluster, uint32_t kProducerRegs, uint32_t kConsumerRegs, class Comm, class Producer,
          class Follower, class Consumer>
__device__ __forceinline__ void run_cta(int comm_ctas, const dev::DeviceComm& dc, const gemm::engine::Smem<C>& sm,
                                        uint64_t* ring_full, uint64_t* ring_empty, uint32_t* abort_word,
                                        const Comm& comm, const Producer& producer, const Follower& follower,
                                        const Consumer& consumer, uint64_t* link_bars = nullptr, int links = 0) {
  using namespace gemm::sm90;
  if (blockIdx.x < uint32_t(comm_ctas)) {
    if (__syncthreads_or(threadIdx.x == 0 && dev::wait_aborted(dc))) return;
    comm();
    return;
  }
  if (!kCluster && __syncthreads_or(threadIdx.x == 0 && dev::wait_aborted(dc))) return;
  const uint32_t rank = kCluster ? cluster_ctarank() : 0u;
  if (threadIdx.x == 0) {
    gemm::engine::init_barriers(sm, kCluster ? 2u : 1u);
    for (int i = 0; i < kSlots; ++i) {
      mbar_init(ring_full + i, 1);
      mbar_init(ring_empty + i, 256);
    }
    for (int i = 0; i < links; ++i) mbar_init(link_bars + i, 1);
    mbar_fence_init();
  }
  if constexpr (kCluster) {
    cluster_sync();  // both CTAs run (DSMEM is valid) and their barriers are initialised
    if (rank == 0 && threadIdx.x == 0) {
      const uint32_t aborted = dev::wait_aborted(dc) ? 1u : 0u;
      *abort_word = aborted;
      st_cluster(cluster_addr(abort_word, 1u), aborted);
    }
    cluster_sync();
    if (*abort_word != 0u) return;  // both CTAs, before any remote operation
  } else {
    __syncthreads();
  }
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x / 32u == 0 && elect_one()) {
      if (kCluster && rank == 1)
        follower();
      else
        producer();
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consumer(rank);
  }
  if constexpr (kCluster) cluster_sync_any();
}

}  // namespace mok::mk::rt
