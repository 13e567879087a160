// mok — the BF16 forward megakernel (see forward_kernel.h and, for the plan, forward_plan.h).
//
// CTA roles (one CTA of 384 threads per SM, all resident: cooperative launch):
//   * blockIdx.x < C: comm CTA. Thread 0 decides, for the whole CTA, the next action: pull the next
//     minibatch (when its ring rows are free) or push the next one (when its FC2 is complete);
//     each thread with a row buffer then moves rows with bulk copies, and thread 0 publishes
//     the minibatch on a counter (release). Pulls run ahead as far as the ring allows; pushes
//     follow FC2 minibatch by minibatch. With push dispatch (ForwardParams::push_dispatch) the
//     dispatch steps instead write this rank's own tokens into each receiver's ring (position by
//     position, receiver by receiver) and count them on the receiver's counter (system scope).
//   * otherwise: compute CTA = the GEMM engine (engine.cuh). The producer thread claims tickets,
//     waits for the task's dependencies (acquire, then a proxy fence before its TMA loads) and
//     hands the tile to both consumer warpgroups through a 3-slot task ring in shared memory.
//     With 2-CTA clusters (ForwardParams::cluster) a ticket is a pair of M tiles: rank 0's
//     producer claims and waits for both, hands rank 1 its tile through distributed shared
//     memory, and the two CTAs share (multicast) the weight tile when both rows use one expert.
//     Each consumer warpgroup runs the tile's MMAs and epilogue, then reports the tile on its
//     counter. The report is lazy: the warpgroup leader waits for its TMA stores and releases
//     the counter once the next tile's first MMAs are in flight, or earlier when it would
//     otherwise wait for the next task or its first operands (the producer may be waiting on
//     this very report). That keeps the store latency off the critical path without any
//     possibility of a cycle.
// Every wait is bounded (the communicator's deadline); an expired wait is recorded once per GPU
// and makes every other wait give up, so the kernel always terminates.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/engine.cuh"
#include "megakernel/forward_kernel.h"
#include "megakernel/forward_setup.h"
#include "mok/errors.hpp"

namespace mok::mk {

namespace {

using namespace mok::gemm::engine;
using C = Cfg<256>;
static_assert(C::kBlockN == kForwardBlockN, "the host plan (forward_setup.h) and the kernel's tiles disagree");
namespace dev = mok::comm::dev;

// Three slots: the producer can publish task i+2 while the consumers finish task i's epilogue
// (measured equal to two slots without clusters; a prefetching producer that claimed task i+1
// during task i's loads measured 2% slower: its ticket atomic stalled the TMA thread mid-tile).
constexpr int kTaskSlots = 3;
constexpr int kStatWords = kForwardStatWords;
// Register split: the producer thread decodes tickets and waits on counters besides issuing TMA,
// which needs more than the plain engine's 40 registers; the consumers give up 8. With clusters
// the producer also stages and copies the partner's task slot (spills below 96); the consumers
// then fit in 200 without spills. The sum must stay within the CTA's allocation at launch
// (168 x 384 = 64512): 128 x 56 + 256 x 224 = 64512; 128 x 96 + 256 x 200 = 63488.
template <bool kCluster>
constexpr uint32_t kMkProducerRegs = kCluster ? 96 : 56;
template <bool kCluster>
constexpr uint32_t kMkConsumerRegs = kCluster ? 200 : 224;
// Wait ids (names registered by the layer).
constexpr uint32_t kWaitTaskDeps = comm::kWaitUserBase + 40;  // "megakernel.task_dependency"
constexpr uint32_t kWaitCommDeps = comm::kWaitUserBase + 41;  // "megakernel.comm_dependency"
constexpr unsigned int kSiteTaskSlot = 0x6e10;
constexpr unsigned int kSiteCommRow = 0x6e11;

// One task handed from the producer to the consumers.
struct TaskSlot {
  Tile tile;
  int32_t kind;
  int32_t gu_row;   // routed row of the tile's first row (FC1: gu keeps every row; FC2: combine)
  int32_t counter;  // counter word reported when the tile is stored (-1: none)
  int32_t n_cols;   // output width of the GEMM (FC1: 2I)
  int32_t rows;     // rows of the tile that hold tokens (<= 64: warpgroup 1 skips its half)
  int32_t flags;    // kSlotDummy, kSlotSharedB (clusters)
  int32_t pad_[2];  // 64 bytes: copied to the partner CTA as 4 x 16-byte stores
};
// Clusters: the CTA recomputes its partner's tile only to keep the shared pipeline in step (odd
// last unit) and stores and reports nothing; B is multicast (both tiles use one weight tile).
constexpr int32_t kSlotDummy = 1;
constexpr int32_t kSlotSharedB = 2;

struct TaskRing {
  TaskSlot* slot;
  uint64_t* full;     // [kTaskSlots], 1 arrival (producer)
  uint64_t* empty;  // [kTaskSlots], 256 arrivals (every consumer thread)
};

__device__ __forceinline__ TaskRing task_ring(uint8_t* smem_raw) {
  uint8_t* p = smem_raw + C::kSmemBytes;  // after the engine's region (8-byte aligned)
  TaskRing r;
  r.slot = reinterpret_cast<TaskSlot*>(p);
  r.full = reinterpret_cast<uint64_t*>(p + kTaskSlots * sizeof(TaskSlot));
  r.empty = r.full + kTaskSlots;
  return r;
}
// Task ring, its barriers, then (clusters) the pair's abort word at the end.
constexpr int kExtraSmem = kTaskSlots * int(sizeof(TaskSlot)) + 2 * kTaskSlots * 8 + 16;
__device__ __forceinline__ uint32_t* abort_word(uint8_t* smem_raw) {
  return reinterpret_cast<uint32_t*>(smem_raw + C::kSmemBytes + kExtraSmem - 16);
}
static_assert(C::kSmemBytes % 16 == 0 && sizeof(TaskSlot) == 64, "task ring alignment");

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

// Optional profile (params.stats != nullptr): kStatWords words per CTA, written once at the end.
// Compute CTAs: span, busy (consumer warpgroup 0: tile MMAs + epilogues), waiting for a task
// (consumer warpgroup 0), dependency waits (producer), tiles, then (consumer warpgroup 0) the wait
// from holding a task to its first stage's MMAs, epilogues, FC2 busy time, FC2 tiles, tiles whose
// B was multicast (clusters), SM cycles over the span (clock64: the average SM clock is word 10 /
// word 0). Comm CTAs: span, pulling, pushing, waiting for work, 0.
struct StatClock {
  unsigned long long* out;
  uint64_t t0;
  __device__ __forceinline__ explicit StatClock(unsigned long long* stats)
      : out(stats ? stats + size_t(blockIdx.x) * kStatWords : nullptr), t0(out ? dev::globaltimer_ns() : 0) {}
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

// ------------------------------------------------------------------------------------------------
// Comm CTAs
// ------------------------------------------------------------------------------------------------
enum CommAction : int32_t { kActPull = 0, kActPush = 1, kActDone = 2 };

// A dispatch step of a comm CTA. Pull: step g = this rank's position g (rows from every owner).
// Push: steps run position-major over the receivers, starting with the next rank (so the ranks
// do not all write to one receiver at once): step i = position i / W of receiver
// (rank + 1 + i % W) % W, this rank's tokens only. A push step past the receiver's last
// position is empty (no rows, no count).
struct DispatchStep {
  int32_t g;      // position in the receiver's plan
  int32_t dest;   // receiver (pull: this rank)
  int32_t total;  // the receiver's routed rows
  bool empty;
};
__device__ __forceinline__ DispatchStep dispatch_step(const ForwardParams& p, const dev::DeviceComm& dc,
                                                      int32_t total, int32_t step) {
  if (!p.push_dispatch) return DispatchStep{step, dc.rank, total, false};
  const int32_t g = step / dc.nranks;
  int32_t d = dc.rank + 1 + (step - g * dc.nranks);
  if (d >= dc.nranks) d -= dc.nranks;
  const int32_t t = p.dest_schedules[d].totals->total_rows;
  return DispatchStep{g, d, t, g >= num_positions(p.plan, t)};
}
// Dispatch steps of this rank: pull, its positions; push, W x the most positions of any receiver.
__device__ __forceinline__ int32_t dispatch_steps(const ForwardParams& p, const dev::DeviceComm& dc,
                                                  int32_t npos) {
  if (!p.push_dispatch) return npos;
  int32_t most = 0;
  for (int32_t d = 0; d < dc.nranks; ++d)
    most = max(most, num_positions(p.plan, p.dest_schedules[d].totals->total_rows));
  return most * dc.nranks;
}

// Push dispatch: receiver d's ring rows of position g are free once its FC2 of g - S is complete
// (one remote word; FC1(g) waits for that FC2 anyway, so landing earlier would gain nothing).
__device__ bool push_dispatch_ready(const ForwardParams& p, const DispatchStep& st) {
  const int32_t s = ring_slots(p.plan);
  if (st.empty || st.g < s) return true;
  const MbRows old = mb_rows(p.plan, st.total, st.g - s);
  return dev::load_acquire(p.counter_peers[st.dest] + p.layout.fc2_done(st.g - s)) >= fc2_mb_target(p.plan, old);
}

__device__ bool pull_ready(const ForwardParams& p, int32_t total, int32_t g) {
  const int32_t s = ring_slots(p.plan);
  if (g < s) return true;
  const MbRows old = mb_rows(p.plan, total, g - s);
  const uint32_t target = fc1_tile_target(p.plan);
  for (int32_t m = old.begin / sched::kBlockM; m < old.end / sched::kBlockM; ++m)
    if (ld_acquire(p.counters + p.layout.fc1_done(m)) < target) return false;
  return true;
}

__device__ bool push_ready(const ForwardParams& p, int32_t total, int32_t g) {
  const MbRows r = mb_rows(p.plan, total, g);
  return ld_acquire(p.counters + p.layout.fc2_done(g)) >= fc2_mb_target(p.plan, r);
}

// Thread 0: the next action of this comm CTA (bounded). kActPull = the next dispatch step.
__device__ int32_t comm_decide(const ForwardParams& p, const dev::DeviceComm& dc, int32_t total, int32_t npos,
                               int32_t nsteps, int32_t pull_next, int32_t push_next) {
  uint64_t start = 0;
#pragma unroll 1
  for (uint32_t spins = 0;; ++spins) {
    if (pull_next < nsteps) {
      const bool ready = p.push_dispatch ? push_dispatch_ready(p, dispatch_step(p, dc, total, pull_next))
                                         : pull_ready(p, total, pull_next);
      if (ready) return kActPull;
    }
    if (push_next < npos && push_ready(p, total, push_next)) return kActPush;
    if (pull_next >= nsteps && push_next >= npos) return kActDone;
    if (spins == 0) start = dev::globaltimer_ns();
    if ((spins & 15u) == 15u) {
      const uint64_t waited = dev::globaltimer_ns() - start;
      if (waited > dc.timeout_ns) {
        // Push dispatch: the receiver whose FC2 counter we may be waiting for.
        const int peer = p.push_dispatch && pull_next < nsteps ? dispatch_step(p, dc, total, pull_next).dest : -1;
        dev::report_timeout(dc, kWaitCommDeps, peer, uint64_t(pull_next), uint64_t(push_next), waited);
        return kActDone;
      }
      if (dev::wait_aborted(dc)) return kActDone;
    }
  }
}

// Shared memory of a comm CTA: the action word and the list count, mbarriers (one per slot),
// with push dispatch a list of row indices (below), one zero row (source of padding rows), then
// `slots` row buffers. Thread t < slots owns slot t and moves one row at a time through it with
// bulk copies (TMA engine): global -> shared (mbarrier), shared -> global (bulk group). Bytes in
// flight per SM ~ slots x row bytes (~210 KB), which is what it takes to run NVLink near its rate
// from few SMs (a warp's ld/st keeps only a few KB in flight).
// Push dispatch: a step's rows are those of this rank among the receiver's rows, and the
// receiver's layout interleaves source ranks row by row, so a fixed row -> thread assignment
// leaves threads idle (with W = 2 and an even stride, half of them get no row of ours at all).
// The CTA therefore lists its rows (kListRows at a time) and the movers take list entries in turn.
constexpr int32_t kListRows = 1024;
struct CommSmem {
  int32_t* cmd;
  int32_t* count;
  uint64_t* bars;
  int32_t* list;  // [kListRows] (push dispatch only)
  uint8_t* zero;
  uint8_t* rows;
  int32_t slots;
};

__device__ __forceinline__ CommSmem comm_smem(uint8_t* smem_raw, uint32_t row_bytes, uint32_t smem_bytes,
                                              bool with_list) {
  CommSmem c;
  c.cmd = reinterpret_cast<int32_t*>(smem_raw);
  c.count = c.cmd + 1;
  c.bars = reinterpret_cast<uint64_t*>(smem_raw + 128);
  constexpr uint32_t kMaxSlots = kThreads;
  uint8_t* base = smem_raw + 128 + kMaxSlots * 8;
  c.list = reinterpret_cast<int32_t*>(base);
  if (with_list) base += kListRows * 4;
  base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + 127u) & ~uintptr_t(127u));
  c.zero = base;
  c.rows = base + row_bytes;
  const uint32_t used = uint32_t(c.rows - smem_raw);
  const uint32_t fit = smem_bytes > used ? (smem_bytes - used) / row_bytes : 0u;
  c.slots = int32_t(fit < kMaxSlots ? fit : kMaxSlots);
  return c;
}

__device__ void comm_cta(const ForwardParams& p, const dev::DeviceComm& dc, uint8_t* smem_raw, uint32_t smem_bytes) {
  const int32_t total = p.schedule.totals->total_rows;
  const int32_t npos = num_positions(p.plan, total);
  const uint32_t row_bytes = uint32_t(p.hidden) * 2u;
  const CommSmem cs = comm_smem(smem_raw, row_bytes, smem_bytes, p.push_dispatch != 0);
  const int32_t t = int32_t(threadIdx.x);
  for (uint32_t b = threadIdx.x * 16u; b < row_bytes; b += blockDim.x * 16u)
    *reinterpret_cast<uint4*>(cs.zero + b) = make_uint4(0u, 0u, 0u, 0u);
  fence_async_shared();  // the zero row is read by bulk copies (async proxy)
  if (t < cs.slots) mbar_init(cs.bars + t, 1);
  mbar_fence_init();
  __syncthreads();
  const bool mover = t < cs.slots;
  uint8_t* my_row = cs.rows + size_t(t) * row_bytes;
  uint64_t* my_bar = cs.bars + t;
  uint32_t parity = 0;
  bool slot_dead = false;  // a row load did not land after an expired wait: the slot is not reused
  const int32_t first = int32_t(blockIdx.x) * cs.slots + t;
  const int32_t stride = p.plan.comm_ctas * cs.slots;
  const int32_t nsteps = dispatch_steps(p, dc, npos);
  const char* const* x_peers = reinterpret_cast<const char* const*>(p.x_peers);
  char* const* combine = reinterpret_cast<char* const*>(p.combine_peers);
  char* x_ring = static_cast<char*>(p.x_ring);
  const char* y_ring = static_cast<const char*>(p.y_ring);
  const int64_t rb = int64_t(row_bytes);
  int32_t pull_next = 0;
  int32_t push_next = p.combine_in_epilogue ? npos : 0;  // the FC2 epilogue pushes: nothing to do
  const StatClock clock(t == 0 ? p.stats : nullptr);
  uint64_t pull_ns = 0, push_ns = 0, idle_ns = 0;
#pragma unroll 1
  for (;;) {
    const uint64_t w0 = clock.now();
    if (t == 0) *cs.cmd = comm_decide(p, dc, total, npos, nsteps, pull_next, push_next);
    __syncthreads();  // orders thread 0's acquire before every thread's copies
    const int32_t act = *cs.cmd;
    const uint64_t w1 = clock.now();
    idle_ns += w1 - w0;
    if (act == kActDone) break;
    // Pull: the step is this rank's position; push dispatch: a receiver's position, whose rows are
    // listed in that receiver's schedule (built here), written into its ring; this rank moves its
    // own tokens there, and the receiver itself its padding rows (zeros).
    const DispatchStep st = act == kActPull ? dispatch_step(p, dc, total, pull_next)
                                            : DispatchStep{push_next, dc.rank, total, false};
    const int32_t g = st.g;
    const gpu::ScheduleView& sv = act == kActPull && p.push_dispatch ? p.dest_schedules[st.dest] : p.schedule;
    const int32_t only_src = act == kActPull && p.push_dispatch ? dc.rank : -1;
    char* ring = act == kActPull && p.push_dispatch ? static_cast<char*>(p.ring_peers[st.dest]) : x_ring;
    MbRows r = mb_rows(p.plan, st.total, g);
    if (st.empty) r.end = r.begin;
    // One row through this thread's slot: global -> shared -> global (zeros for padding rows).
    const auto move_row = [&](int32_t row) {
      const int32_t src = sv.src_rank[row];
      const int32_t slot = sv.src_slot[row];
      const int64_t ring_row = int64_t(r.ring + (row - r.begin));
      const char* from;
      char* to;
      if (act == kActPull) {
        from = src >= 0 ? x_peers[src] + int64_t(slot / p.top_k) * rb : nullptr;
        to = ring + ring_row * rb;
      } else {
        if (src < 0) return;  // padding rows are not pushed
        from = y_ring + ring_row * rb;
        to = combine[src] + int64_t(slot) * rb;
      }
      const uint8_t* staged = cs.zero;
      if (slot_dead) return;  // a load into the slot may still be in flight
      if (from != nullptr) {
        mbar_arrive_expect_tx(my_bar, row_bytes);
        bulk_load(my_row, from, row_bytes, my_bar);
        // After an expired wait (here or elsewhere) let the load land before the slot, and at the
        // end the CTA, goes away; if it does not land in time, load nothing more into the slot.
        if (!mbar_wait(my_bar, parity, WaitBound{dc.claim, dc.timeout_ns}, kSiteCommRow) &&
            !mbar_drain(my_bar, parity, dev::globaltimer_ns() + dc.timeout_ns))
          slot_dead = true;
        parity ^= 1u;
        staged = my_row;
      }
      bulk_store(to, staged, row_bytes);
      tma_store_commit();
      tma_store_wait_read<0>();  // the slot is free again
    };
    // Thread 0's acquire (ordered before us by the barrier) covers generic-proxy accesses; our
    // bulk copies are async proxy: ring rows written by TMA stores (push) or read by TMA loads
    // (pull) on other SMs.
    if (mover) dev::fence_proxy_async();
    if (only_src >= 0) {
      // Push dispatch: CTA c takes the c-th block of the step's rows, lists the ones this rank
      // writes (its tokens; at home also the padding rows), and its movers take them in turn.
      // The list order varies from run to run; each row has one destination, so the bits do not.
      const int32_t len = r.end - r.begin, per = (len + p.plan.comm_ctas - 1) / p.plan.comm_ctas;
      const int32_t lo = r.begin + min(len, int32_t(blockIdx.x) * per);
      const int32_t hi = r.begin + min(len, (int32_t(blockIdx.x) + 1) * per);
#pragma unroll 1
      for (int32_t a = lo; a < hi; a += kListRows) {
        const int32_t b = min(hi, a + kListRows);
        if (t == 0) *cs.count = 0;
        __syncthreads();
        for (int32_t row = a + t; row < b; row += int32_t(blockDim.x)) {
          const int32_t src = sv.src_rank[row];
          if (src == only_src || (src < 0 && st.dest == dc.rank)) cs.list[atomicAdd(cs.count, 1)] = row;
        }
        __syncthreads();
        const int32_t n = *cs.count;
        if (mover)
          for (int32_t i = t; i < n; i += cs.slots) move_row(cs.list[i]);
        __syncthreads();  // the list is refilled next
      }
    } else if (mover) {
#pragma unroll 1
      for (int32_t row = r.begin + first; row < r.end; row += stride) move_row(row);
    }
    if (mover) {
      tma_store_wait_all<0>();   // this thread's rows are written
      dev::fence_proxy_async();  // ... and ordered before thread 0's release, per issuing thread
    }
    __syncthreads();  // every thread's rows are written (and thread 0 may overwrite the action)
    if (t == 0) {
      // The ring rows are read next by TMA (async proxy) on other SMs.
      dev::fence_proxy_async();
      if (act == kActPull && p.push_dispatch) {
        // Rows written into another GPU's ring: count them there, released at system scope.
        if (!st.empty) dev::add_release(p.counter_peers[st.dest] + p.layout.pulled(g), 1u);
      } else {
        red_release(p.counters + (act == kActPull ? p.layout.pulled(g) : p.layout.pushed(g)), 1u);
      }
    }
    (act == kActPull ? pull_ns : push_ns) += clock.now() - w1;
    if (act == kActPull)
      ++pull_next;
    else
      ++push_next;
  }
  if (clock.out) {
    clock.out[kStatCommSpan] = clock.now() - clock.t0;
    clock.out[kStatPull] = pull_ns;
    clock.out[kStatPush] = push_ns;
    clock.out[kStatIdle] = idle_ns;
    clock.out[kStatIdle + 1] = 0;
  }
}

// ------------------------------------------------------------------------------------------------
// Compute CTAs
// ------------------------------------------------------------------------------------------------
// Producer thread: waits for the dependencies of task `tk` (see forward_plan.h). False on timeout.
__device__ bool wait_deps(const ForwardParams& p, const dev::DeviceComm& dc, int32_t total, const Task& tk) {
  const uint32_t* c = p.counters;
  const CounterLayout& L = p.layout;
  const int32_t s = ring_slots(p.plan);
  switch (tk.kind) {
    case kTaskFc1:
      // Pull: this rank's C comm CTAs; push: the C comm CTAs of every rank (other GPUs: system scope).
      if (p.push_dispatch ? !wait_counter(dc, c + L.pulled(tk.g), uint32_t(p.plan.comm_ctas * dc.nranks),
                                          kWaitTaskDeps, true)
                          : !wait_counter(dc, c + L.pulled(tk.g), uint32_t(p.plan.comm_ctas), kWaitTaskDeps))
        return false;
      if (tk.g >= s) {
        const MbRows old = mb_rows(p.plan, total, tk.g - s);
        if (!wait_counter(dc, c + L.fc2_done(tk.g - s), fc2_mb_target(p.plan, old), kWaitTaskDeps)) return false;
      }
      return true;
    case kTaskFc2:
      for (int32_t m = tk.m; m < tk.m + tk.tiles; ++m)
        if (!wait_counter(dc, c + L.fc1_done(m), fc1_tile_target(p.plan), kWaitTaskDeps)) return false;
      if (!p.combine_in_epilogue && tk.g >= s &&
          !wait_counter(dc, c + L.pushed(tk.g - s), uint32_t(p.plan.comm_ctas), kWaitTaskDeps))
        return false;
      return true;
    case kTaskShared2:
      for (int32_t m = tk.m; m < tk.m + tk.tiles; ++m)
        if (!wait_counter(dc, c + L.s1_done(m), s1_tile_target(p.plan), kWaitTaskDeps)) return false;
      return true;
    default:
      return true;
  }
}

// Writes the engine tile (M tile m of task tk) and its report counter into the task slot `s`.
__device__ __forceinline__ void fill_slot(TaskSlot& s, const ForwardParams& p, int32_t total, const Task& tk,
                                          int32_t m, int32_t flags) {
  s.kind = tk.kind;
  s.counter = -1;
  s.flags = flags;
  if (tk.kind == kTaskEnd) return;
  const int32_t b_n = tk.n * C::kBlockN;
  const int32_t kb1 = p.hidden / kBlockK;
  if (tk.kind == kTaskFc1 || tk.kind == kTaskFc2) {
    const MbRows r = mb_rows(p.plan, total, tk.g);
    const int32_t ring_row = r.ring + m * sched::kBlockM - r.begin;
    const int32_t expert = p.schedule.tile_expert[m];
    // Token rows of this tile: the expert's segment holds expert_rows[e] tokens, then padding.
    s.rows = min(int32_t(sched::kBlockM),
                 p.schedule.expert_offset[expert] + p.schedule.expert_rows[expert] - m * sched::kBlockM);
    if (tk.kind == kTaskFc1) {
      s.tile = Tile{ring_row, b_n, expert, 0, kb1, kBlockK, ring_row, 0};
      s.gu_row = m * sched::kBlockM;
      s.counter = flags & kSlotDummy ? -1 : p.layout.fc1_done(m);
      s.n_cols = 2 * p.inter;
    } else {
      s.tile = Tile{ring_row, b_n, expert, 0, p.inter / kBlockK, kBlockK, ring_row, 0};
      s.gu_row = m * sched::kBlockM;  // the routed row (schedule index) of the tile's first row
      s.counter = flags & kSlotDummy ? -1 : p.layout.fc2_done(tk.g);
      s.n_cols = p.hidden;
    }
  } else {
    const int32_t row = m * sched::kBlockM;
    s.rows = min(int32_t(sched::kBlockM), p.tokens - row);
    if (tk.kind == kTaskShared1) {
      s.tile = Tile{row, b_n, 0, 0, kb1, kBlockK, row, 0};
      s.gu_row = row;
      s.counter = flags & kSlotDummy ? -1 : p.layout.s1_done(m);
      s.n_cols = 2 * p.shared_inter;
    } else {
      s.tile = Tile{row, b_n, 0, 0, p.shared_inter / kBlockK, kBlockK, row, 0};
      s.n_cols = p.hidden;
    }
  }
}

// The next task that is not Skip (tickets past the end decode to End).
__device__ __forceinline__ Task claim_task(const ForwardParams& p, int32_t total) {
#pragma unroll 1
  for (;;) {
    const int32_t ticket = int32_t(atomicAdd(p.counters + p.layout.ticket(), 1u));
    const Task tk = decode_ticket(p.plan, total, ticket);
    if (tk.kind != kTaskSkip) return tk;
  }
}

// Position of the producer (or of the consumers) in the task ring.
struct SlotCursor {
  uint32_t i = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++i == uint32_t(kTaskSlots)) {
      i = 0;
      phase ^= 1u;
    }
  }
};

// Operand maps of a task kind. Clusters: `b_half` is the weight map with a box of BLOCK_N/2 rows
// (each CTA loads and multicasts half of a shared B tile).
struct TaskMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* b_half;
};
__device__ __forceinline__ TaskMaps task_maps(const ForwardMaps& maps, int32_t kind) {
  switch (kind) {
    case kTaskFc2:
      return TaskMaps{&maps.h_in, &maps.w_down, &maps.w_down_half};
    case kTaskShared1:
      return TaskMaps{&maps.xs_in, &maps.ws1p, &maps.ws1p_half};
    case kTaskShared2:
      return TaskMaps{&maps.hs_in, &maps.ws_down, &maps.ws_down_half};
    default:
      return TaskMaps{&maps.x_ring, &maps.w1p, &maps.w1p_half};
  }
}

// Hands task tk to the consumers in the producer's next slot. Clusters (rank 0 only): the pair's
// second tile (or, for a one-tile unit, a dummy copy of the first) goes into the same slot of the
// rank-1 CTA through distributed shared memory, released at cluster scope; rank 0's slot empties
// once both CTAs' consumers are done with it. Returns rank 0's slot, or null when the slot never
// became free (never expected: a broken invariant): the slot is then left untouched, since the
// consumers may still be reading it, and the producer stops; the consumers end through their own
// bounded hand-off waits.
template <bool kCluster>
__device__ __forceinline__ TaskSlot* publish(const TaskRing& ring, SlotCursor& c, const ForwardParams& p,
                                             int32_t total, Task tk, const WaitBound& wb) {
  // Clusters: acquire.cluster pairs with rank 1's releases of its copy of this slot.
  if (!handoff_wait<kCluster>(ring.empty + c.i, c.phase ^ 1u, wb)) return nullptr;
  TaskSlot* slot = ring.slot + c.i;  // stays valid until the consumers release it after the tile
  int32_t shared = 0;
  if constexpr (kCluster) {
    // B is shared when both tiles use one expert; a dummy repeats rank 0's tile, so always then.
    if (tk.kind != kTaskEnd) {
      const bool routed = tk.kind == kTaskFc1 || tk.kind == kTaskFc2;
      shared = tk.tiles < 2 || !routed ||
                       __ldg(p.schedule.tile_expert + tk.m) == __ldg(p.schedule.tile_expert + tk.m + 1)
                   ? kSlotSharedB
                   : 0;
    }
    // Rank 1's tile, staged in our slot and copied as 4 x 16 bytes.
    fill_slot(*slot, p, total, tk, tk.tiles == 2 ? tk.m + 1 : tk.m, shared | (tk.tiles == 2 ? 0 : kSlotDummy));
    const uint4* v = reinterpret_cast<const uint4*>(slot);
    const uint32_t remote = cluster_addr(slot, 1u);
#pragma unroll
    for (uint32_t w = 0; w < sizeof(TaskSlot) / 16; ++w) st_cluster_v4(remote + 16u * w, v[w]);
    mbar_arrive_remote_release(ring.full + c.i, 1u);
  }
  fill_slot(*slot, p, total, tk, tk.m, shared);
  mbar_arrive(ring.full + c.i);  // release (CTA scope): the slot's contents before the arrival
  c.advance();
  return slot;
}

// Producer thread (rank 0 of a cluster, or every compute CTA without clusters): claims a ticket,
// waits for its dependencies, hands the task over, then issues the tile's loads.
template <bool kCluster>
__device__ void producer(const ForwardMaps& maps, const ForwardParams& p, const dev::DeviceComm& dc,
                         const Smem<C>& sm, const TaskRing& ring, const WaitBound& wb) {
  const int32_t total = p.schedule.totals->total_rows;
  PipeState<C> ps;
  SlotCursor cur;
  const StatClock clock(p.stats);
  uint64_t dep_ns = 0;
  bool issuing = true;  // false once a wait for a free stage expired: hand out End next
#pragma unroll 1
  for (;;) {
    Task tk = issuing ? claim_task(p, total) : Task{kTaskEnd, -1, -1, -1, 0};
    const uint64_t d0 = clock.now();
    if (tk.kind != kTaskEnd && !wait_deps(p, dc, total, tk)) tk.kind = kTaskEnd;
    dep_ns += clock.now() - d0;
    const TaskSlot* slot = publish<kCluster>(ring, cur, p, total, tk, wb);
    if (slot == nullptr || tk.kind == kTaskEnd) break;
    dev::fence_proxy_async();  // the acquired rows are read by TMA next
    const TaskMaps tm = task_maps(maps, tk.kind);
    issuing = produce_tile<C, false, false, kCluster>(sm, ps, slot->tile, tm.a, tm.b, wb, tm.b_half,
                                                      (slot->flags & kSlotSharedB) != 0, 0u);
  }
  if (clock.out) clock.out[kStatDeps] = dep_ns;
  drain_stages(sm, ps, wb);
  if constexpr (kCluster) producer_tail(sm, ps, wb);
}

// Producer thread of a cluster's rank-1 CTA: takes its tiles from its own task slots (written by
// rank 0, which did the dependency waits; its cluster-scope release orders them before our
// acquire) and issues its loads: its A tile, and its half of a shared B tile or its own B.
__device__ void follower_producer(const ForwardMaps& maps, const Smem<C>& sm, const TaskRing& ring,
                                  const WaitBound& wb) {
  PipeState<C> ps;
  SlotCursor cur;
#pragma unroll 1
  for (;;) {
    if (!handoff_wait<true>(ring.full + cur.i, cur.phase, wb)) break;  // never expected
    const TaskSlot& slot = ring.slot[cur.i];
    const int32_t kind = slot.kind;
    const Tile t = slot.tile;
    const bool shared = (slot.flags & kSlotSharedB) != 0;
    cur.advance();
    if (kind == kTaskEnd) break;
    dev::fence_proxy_async();  // rows acquired (through rank 0) are read by TMA next
    const TaskMaps tm = task_maps(maps, kind);
    if (!produce_tile<C, false, false, true>(sm, ps, t, tm.a, tm.b, wb, tm.b_half, shared, 1u)) break;
  }
  drain_stages(sm, ps, wb);
  producer_tail(sm, ps, wb);
}

// FC2 epilogue with the combine folded in: each 64-column chunk goes registers -> the warpgroup's
// shared chunk buffer (stmatrix, 128-byte swizzle) -> 16-byte stores of whole 128-byte row pieces
// straight into the owner's combine slot (peer memory over NVLink, or local). Thread wt moves
// unit wt % 8 of rows wt / 8 + 16 i; padding rows are skipped. Visibility at the owner comes from
// the kernel's end and the LSA barrier after it.
__device__ __forceinline__ void epilogue_combine(const ForwardParams& p, const Smem<C>& sm, EpiState& es, int cwg,
                                                 uint32_t wt, const float (&acc)[C::kAccRegs], int32_t routed_row,
                                                 int32_t b_n) {
  const bool leader = wt == 0;
  // epi_begin lets the newest TMA store group still read "the other" buffer; this epilogue issues
  // no TMA stores, so an earlier tile's store could still be reading either buffer.
  if (leader) tma_store_wait_read<0>();
  const int32_t row0 = routed_row + 64 * cwg;
  const int64_t row_bytes = int64_t(p.hidden) * 2;
  char* const* combine = reinterpret_cast<char* const*>(p.combine_peers);
  const uint32_t unit = wt % 8u;
#define MOK_COMBINE_CHUNK(CH)                                                                     \
  if (b_n + 64 * (CH) < p.hidden) {                                                               \
    uint8_t* buf = epi_begin(sm, cwg, es, leader);                                                \
    write_chunk_bf16<8 * (CH)>(buf, acc, wt);                                                     \
    named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);                                            \
    _Pragma("unroll") for (uint32_t i = 0; i < 4; ++i) {                                          \
      const uint32_t r = wt / 8u + 16u * i;                                                       \
      const int32_t src = p.schedule.src_rank[row0 + int32_t(r)];                                 \
      if (src >= 0) {                                                                             \
        const int64_t slot = p.schedule.src_slot[row0 + int32_t(r)];                              \
        const uint4 v = *reinterpret_cast<const uint4*>(buf + r * 128u + ((unit ^ (r % 8u)) << 4)); \
        *reinterpret_cast<uint4*>(combine[src] + slot * row_bytes + int64_t(b_n + 64 * (CH)) * 2 + unit * 16u) = v; \
      }                                                                                           \
    }                                                                                             \
    ++es.chunks;                                                                                  \
  }
  MOK_COMBINE_CHUNK(0)
  MOK_COMBINE_CHUNK(1)
  MOK_COMBINE_CHUNK(2)
  MOK_COMBINE_CHUNK(3)
#undef MOK_COMBINE_CHUNK
}

// Warpgroup leader: the previous tile's stores are complete and visible, then its counter.
// `sys`: push dispatch with ring reuse, where other GPUs acquire fc2_done before they overwrite
// this GPU's ring rows (whose last reads, FC1's TMA loads, precede this report), so fc2_done
// words are released at system scope. It costs: a system-scope fence in the leader stalls its
// warpgroup for microseconds (measured: push dispatch with it on every report was 13% slower
// on DeepSeek-V3).
__device__ __forceinline__ void report(const ForwardParams& p, int32_t& pending, bool sys) {
  if (pending < 0) return;
  tma_store_wait_all<0>();
  dev::fence_proxy_async();
  if (sys && pending >= p.layout.fc2_done(0) && pending < p.layout.fc1_done(0))  // fc2_done words only
    dev::add_release(p.counters + pending, 1u);
  else
    red_release(p.counters + pending, 1u);
  pending = -1;
}

// Consumer warpgroups. Clusters: every stage is released to both CTAs (the partner may have
// multicast into it); a dummy tile is computed but neither stored nor reported; rank 1 releases
// its task slot to rank 0, whose producer fills both.
template <bool kCluster>
__device__ void consumer(const ForwardMaps& maps, const ForwardParams& p, const Smem<C>& sm, const TaskRing& ring,
                         const WaitBound& wb, uint32_t rank) {
  const uint32_t peer = rank ^ 1u;
  const int cwg = int(threadIdx.x / 128u) - 1;
  const uint32_t wt = threadIdx.x % 128u;
  const uint32_t ct = threadIdx.x - 128u;
  const bool leader = wt == 0;
  PipeState<C> ps;
  EpiState es;
  Skew<C> skew;  // optional stagger of the two warpgroups (ForwardParams::skew_stages)
  float acc[C::kAccRegs];
  int32_t pending = -1;  // leader only: counter of the last stored tile, not yet reported
  SlotCursor cur;
  const StatClock clock(leader && cwg == 0 ? p.stats : nullptr);
  uint64_t busy_ns = 0, wait_ns = 0, tiles = 0, start_ns = 0, epi_ns = 0, fc2_ns = 0, fc2_tiles = 0, mc_tiles = 0;
  const uint64_t c0 = clock.out ? clock64() : 0;
  // Other GPUs read our counters only to reuse ring rows under push dispatch (see report()).
  const bool sys_reports =
      p.push_dispatch && num_positions(p.plan, p.schedule.totals->total_rows) > ring_slots(p.plan);
#pragma unroll 1
  for (;;) {
    const uint64_t w0 = clock.now();
    if (leader && pending >= 0 && !mbar_test(ring.full + cur.i, cur.phase)) report(p, pending, sys_reports);
    // Every thread waits, then a barrier-and makes the warpgroup agree: an expiry seen by some
    // threads only would split the warpgroup at its next wgmma or barrier (an unbounded hang).
    // Rank 1's slots are written by rank 0 (cluster scope).
    const bool got = named_bar_and(kBarEpilogue + uint32_t(cwg), 128,
                                   kCluster && rank == 1 ? handoff_wait<true>(ring.full + cur.i, cur.phase, wb)
                                                         : handoff_wait<false>(ring.full + cur.i, cur.phase, wb));
    const uint64_t w1 = clock.now();
    wait_ns += w1 - w0;
    // The slot is read in place (fewer live registers next to the accumulators) and released
    // after the epilogue; the producer meanwhile fills the next slot.
    const TaskSlot& slot = ring.slot[cur.i];
    const int32_t kind = got ? slot.kind : int32_t(kTaskEnd);
    if (kind == kTaskEnd) break;
    if (leader && pending >= 0 && !mbar_test(sm.full(ps.stage), ps.phase)) report(p, pending, sys_reports);
    const auto report_previous = [&] {
      if (clock.out) start_ns += clock.now() - w1;  // profile: the tile's first stage arrived
      if (leader) report(p, pending, sys_reports);
    };
    uint64_t e0 = 0;  // profile: start of the epilogue
    const bool half = slot.rows <= 64;
    const bool combine = kind == kTaskFc2 && p.combine_in_epilogue;
    const bool dummy = (slot.flags & kSlotDummy) != 0;
    if (half && p.split_n && !combine) {
      // Tokens only in rows 0..63: both warpgroups on those rows, each on half of the columns.
      mma_tile_split_n<C, kCluster>(sm, ps, slot.tile, cwg, acc, wb, peer, report_previous);
      e0 = clock.now();
      const Tile& t = slot.tile;
      if (dummy) {
      } else if (kind == kTaskFc1 || kind == kTaskShared1) {
        const bool routed = kind == kTaskFc1;
        const CUtensorMap* gu_map = !p.save_gu ? nullptr : routed ? &maps.gu : &maps.gus_out;
        epilogue_fc1_split_n<C>(sm, es, cwg, wt, acc, gu_map, slot.gu_row,
                                routed ? &maps.h_out : &maps.hs_out, t.out_row, t.b_n, slot.n_cols);
      } else {
        epilogue_store_split_n<C>(sm, es, cwg, wt, acc, kind == kTaskFc2 ? &maps.y_out : &maps.ys_out, t.out_row,
                                  t.b_n, slot.n_cols);
      }
    } else if (half && cwg == 1) {
      // This warpgroup's rows are all padding: keep the pipeline in step, compute and store nothing.
      skip_tile<C, kCluster>(sm, ps, slot.tile, wb, peer, report_previous);
      e0 = clock.now();
    } else {
      skew.stages = slot.rows <= 64 ? 0 : p.skew_stages;  // same choice in both warpgroups
      mma_tile<C, false, false, false, kCluster>(sm, ps, slot.tile, cwg, ct, acc, wb, skew, peer, report_previous);
      e0 = clock.now();
      const Tile& t = slot.tile;
      if (dummy) {
      } else if (kind == kTaskFc1 || kind == kTaskShared1) {
        const bool routed = kind == kTaskFc1;
        const CUtensorMap* gu_map = !p.save_gu ? nullptr : routed ? &maps.gu : &maps.gus_out;
        epilogue_fc1<C>(sm, es, cwg, wt, acc, gu_map, slot.gu_row,
                        routed ? &maps.h_out : &maps.hs_out, t.out_row, t.b_n, slot.n_cols);
      } else if (kind == kTaskFc2 && p.combine_in_epilogue) {
        epilogue_combine(p, sm, es, cwg, wt, acc, slot.gu_row, t.b_n);
      } else {
        epilogue_store<C>(sm, es, cwg, wt, acc, kind == kTaskFc2 ? &maps.y_out : &maps.ys_out, t.out_row,
                             t.b_n, slot.n_cols);
      }
    }
    if (leader) {
      report(p, pending, sys_reports);  // normally already done by the first-block hook (then a no-op)
      pending = slot.counter;
    }
    const uint64_t w2 = clock.now();
    busy_ns += w2 - w1;
    epi_ns += w2 - e0;
    if (kind == kTaskFc2) {
      fc2_ns += w2 - w1;
      ++fc2_tiles;
    }
    ++tiles;
    mc_tiles += (slot.flags & kSlotSharedB) != 0 ? 1u : 0u;
    if (kCluster && rank == 1) {
      __syncwarp();  // the warp's reads of the slot are done
      if (lane_id() == 0) mbar_arrive_remote_release(ring.empty + cur.i, 0u);
    } else {
      mbar_arrive(ring.empty + cur.i);
    }
    cur.advance();
  }
  if (leader) report(p, pending, sys_reports);
  epi_finish(leader);
  if (clock.out) {
    clock.out[kStatSpan] = clock.now() - clock.t0;
    clock.out[kStatBusy] = busy_ns;
    clock.out[kStatWaitTask] = wait_ns;
    clock.out[kStatTiles] = tiles;
    clock.out[kStatFirstStage] = start_ns;
    clock.out[kStatEpilogue] = epi_ns;
    clock.out[kStatFc2] = fc2_ns;
    clock.out[kStatFc2Tiles] = fc2_tiles;
    clock.out[kStatMulticast] = mc_tiles;
    clock.out[kStatCycles] = clock64() - c0;
  }
}

template <bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    forward_megakernel(const __grid_constant__ ForwardMaps maps, const __grid_constant__ ForwardParams p,
                       const __grid_constant__ dev::DeviceComm dc) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const TaskRing ring = task_ring(smem_raw);
  if (blockIdx.x < uint32_t(p.plan.comm_ctas)) {
    // A wait of an earlier kernel on this GPU expired: the communicator is poisoned, do nothing.
    if (__syncthreads_or(threadIdx.x == 0 && dev::wait_aborted(dc))) return;
    comm_cta(p, dc, smem_raw, uint32_t(C::kSmemBytes) + uint32_t(kExtraSmem));
    return;
  }
  // Compute CTAs. Clusters: the pair decides together (rank 0 reads the flag and writes it into
  // both CTAs, between two cluster barriers) whether to stop at once, so neither CTA leaves while
  // the other could still write into its shared memory.
  if (!kCluster && __syncthreads_or(threadIdx.x == 0 && dev::wait_aborted(dc))) return;
  const Smem<C> sm = smem_view<C>(smem_raw);
  const uint32_t rank = kCluster ? cluster_ctarank() : 0u;
  if (threadIdx.x == 0) {
    init_barriers(sm, kCluster ? 2u : 1u);
    for (int i = 0; i < kTaskSlots; ++i) {
      mbar_init(ring.full + i, 1);
      mbar_init(ring.empty + i, kCluster ? 256 + 8 : 256);  // + rank 1's consumer warps
    }
    mbar_fence_init();
  }
  if constexpr (kCluster) {
    cluster_sync();  // both CTAs run (DSMEM is valid) and their barriers are initialised
    if (rank == 0 && threadIdx.x == 0) {
      const uint32_t aborted = dev::wait_aborted(dc) ? 1u : 0u;
      *abort_word(smem_raw) = aborted;
      st_cluster(cluster_addr(abort_word(smem_raw), 1u), aborted);
    }
    cluster_sync();
    if (*abort_word(smem_raw) != 0u) return;  // both CTAs, before any remote operation
  } else {
    __syncthreads();
  }
  const WaitBound wb{dc.claim, dc.timeout_ns};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kMkProducerRegs<kCluster>>();
    if (threadIdx.x / 32u == 0 && elect_one()) {
      if (kCluster && rank == 1)
        follower_producer(maps, sm, ring, wb);
      else
        producer<kCluster>(maps, p, dc, sm, ring, wb);
    }
  } else {
    setmaxnreg_inc<kMkConsumerRegs<kCluster>>();
    consumer<kCluster>(maps, p, sm, ring, wb, rank);
  }
  if constexpr (kCluster) cluster_sync_any();
}

}  // namespace

static_assert(C::kSmemBytes + kExtraSmem <= 232448, "the megakernel's shared memory exceeds 227 KB");

int forward_smem_bytes() { return int(C::kSmemBytes) + kExtraSmem; }

int forward_max_hidden() {
  // A comm CTA needs its action word, kThreads mbarriers, (push dispatch) its row list, one zero
  // row and >= 1 row buffer.
  return (forward_smem_bytes() - 128 - kThreads * 8 - kListRows * 4 - 256) / 2 / 2;
}

namespace {
cudaLaunchConfig_t launch_config(int grid, bool cluster, cudaStream_t stream, cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg{};
  attr[0].id = cudaLaunchAttributeCooperative;  // all CTAs co-resident, or the launch fails
  attr[0].val.cooperative = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = 2;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(forward_smem_bytes());
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = cluster ? 2 : 1;
  return cfg;
}
}  // namespace

int prepare_forward(int comm_ctas, int grid, bool cluster) {
  const int smem = forward_smem_bytes();
  int per_sm = 0;
  if (cluster) {
    // Pairs of CTAs: the grid and the comm CTAs come in whole clusters.
    grid -= grid % 2;
    MOK_REQUIRE(comm_ctas % 2 == 0, "config.fwd_comm_sms", "must be even with 2-CTA clusters, got ", comm_ctas);
    MOK_CUDA_CHECK(cudaFuncSetAttribute(forward_megakernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchAttribute attr[2];
    cudaLaunchConfig_t cfg = launch_config(grid, true, nullptr, attr);
    cfg.attrs = attr + 1;  // the occupancy query takes the cluster shape alone
    cfg.numAttrs = 1;
    int clusters = 0;
    MOK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, forward_megakernel<true>, &cfg));
    grid = std::min(grid, 2 * clusters);  // some SMs may not pair up
    per_sm = 1;
  } else {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(forward_megakernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    MOK_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, forward_megakernel<false>, kThreads, smem));
  }
  MOK_REQUIRE(comm_ctas >= 1 && comm_ctas < grid, "config.fwd_comm_sms", "must be in [1, grid) = [1, ", grid,
              "), got ", comm_ctas);
  int dev = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (per_sm < 1 || grid > per_sm * sms)
    throw Error(ErrorKind::Runtime, "megakernel", "cannot keep every CTA resident",
                detail::concat(grid, " CTAs asked, ", per_sm, " per SM x ", sms, " SMs fit"));
  return grid;
}

void launch_forward(const ForwardMaps& maps, const ForwardParams& params, const comm::dev::DeviceComm& dc,
                    int grid, cudaStream_t stream) {
  MOK_REQUIRE(params.plan.pair == params.cluster, "megakernel parameters",
              "plan.pair and cluster must agree (a ticket's tiles go to the CTAs of one cluster)");
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, params.cluster != 0, stream, attr);
  if (params.cluster)
    MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, forward_megakernel<true>, maps, params, dc));
  else
    MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, forward_megakernel<false>, maps, params, dc));
}

}  // namespace mok::mk
