// mok — the forward megakernel's comm CTAs: the next action of a comm CTA (pull the next
// minibatch when its ring rows are free, or push the next one when its FC2 is complete; with push
// dispatch, write this rank's tokens into the receivers' rings), and the row movers (bulk copies
// through shared memory). Private to the forward program: included by forward_kernel.cu only.
#pragma once

#include <cstdint>

#include "megakernel/forward_common.cuh"

namespace mok::mk {

namespace {

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
  const uint32_t row_bytes = uint32_t(p.hidden) * 2u;  // a bf16 row: every slot holds one
  // FP8: a row's 1 x 128 scales (H / 128 floats; H a multiple of 512 keeps them whole 16 bytes).
  const uint32_t scale_bytes = kFp8 ? uint32_t(p.hidden) / 32u : 0u;
  const CommSmem cs = comm_smem(smem_raw, row_bytes, smem_bytes, p.push_dispatch != 0);
  const int32_t t = int32_t(threadIdx.x);
  for (uint32_t b = threadIdx.x * 16u; b < row_bytes; b += blockDim.x * 16u)
    *reinterpret_cast<uint4*>(cs.zero + b) = make_uint4(0u, 0u, 0u, 0u);
  fence_async_shared();  // the zero row is read by bulk copies (async proxy)
  if (t < cs.slots) mbar_init(cs.bars + t, 1);
  mbar_fence_init();
  __syncthreads();
  const bool mover = t < cs.slots;
  // Each mover takes its rows one after another through its own slot, whose reuse is ordered by
  // the slot's mbarrier and the bulk store's read wait. With p.mover_rounds (racecheck runs:
  // scripts/sanitize.sh) the movers go in rounds of one row each with a CTA barrier between rounds
  // (every thread takes part: the round count is uniform). compute-sanitizer's racecheck does not
  // see the ordering above for bulk copies and reports every refill of a slot as a write-after-write
  // race (attributed to other threads) whenever a mover takes two rows in one step; the barrier is
  // one it models. It orders nothing the copies rely on, and it costs: each round waits for its
  // slowest load (one H100, EP 1: +2-3.5% at Qwen3-30B-A3B, +6% at its EP-8 slice;
  // bench/results/movers-rounds-ab-h100x1.json), so the layer runs without it. (A named barrier
  // over the movers' warps silenced those reports too, but racecheck then reported the action
  // word, written by thread 0 after the step's closing __syncthreads, as racing with the step's
  // reads.)
  uint8_t* my_row = cs.rows + size_t(t) * row_bytes;
  uint64_t* my_bar = cs.bars + t;
  uint32_t parity = 0;
  bool slot_dead = false;  // a row load did not land after an expired wait: the slot is not reused
  const int32_t first = int32_t(blockIdx.x) * cs.slots + t;
  const int32_t stride = p.plan.comm_ctas * cs.slots;
  const int32_t nsteps = dispatch_steps(p, dc, npos);
  const char* const* x_peers = reinterpret_cast<const char* const*>(p.x_peers);
  const char* const x_local = static_cast<const char*>(p.x_local);  // (set only where every src is this rank)
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
    // FP8 pulls: the row's H code bytes and, behind them in the slot, its H / 32 scale bytes (two
    // loads on one barrier, two stores: the x ring's codes and its scales); pushes stay bf16.
    const auto move_row = [&](int32_t row) {
      const int32_t src = sv.src_rank[row];
      const int32_t slot = sv.src_slot[row];
      const int64_t ring_row = int64_t(r.ring + (row - r.begin));
      const char* from;
      char* to;
      const char* from_scales = nullptr;
      char* to_scales = nullptr;
      uint32_t bytes = row_bytes;
      if (act == kActPull) {
        const int64_t token = int64_t(slot / p.top_k);
        if constexpr (kFp8) {
          bytes = uint32_t(p.hidden);
          from = src >= 0 ? x_peers[src] + token * bytes : nullptr;
          from_scales = src >= 0 ? x_peers[src] + p.x_scale_offset + token * scale_bytes : nullptr;
          to = ring + ring_row * bytes;
          to_scales = reinterpret_cast<char*>(p.x_scales_ring) + ring_row * scale_bytes;
        } else {
          from = src >= 0 ? (x_local != nullptr ? x_local : x_peers[src]) + token * rb : nullptr;
          to = ring + ring_row * rb;
        }
      } else {
        if (src < 0) return;  // padding rows are not pushed
        from = y_ring + ring_row * rb;
        to = combine[src] + int64_t(slot) * rb;
      }
      const uint8_t* staged = cs.zero;
      if (slot_dead) return;  // a load into the slot may still be in flight
      if (from != nullptr) {
        // The slot's previous row has been read out by its bulk store (issued by this thread for
        // its previous row): waited for here, where the slot is refilled, rather than right after
        // the store, so the store's read overlaps the next row's address math (and, in rounds, the
        // round barrier).
        tma_store_wait_read<0>();
        mbar_arrive_expect_tx(my_bar, bytes + (from_scales != nullptr ? scale_bytes : 0u));
        bulk_load(my_row, from, bytes, my_bar);
        if (from_scales != nullptr) bulk_load(my_row + bytes, from_scales, scale_bytes, my_bar);
        // After an expired wait (here or elsewhere) let the load land before the slot, and at the
        // end the CTA, goes away; if it does not land in time, load nothing more into the slot
        // and store nothing from it (the load may still be writing it; the call fails anyway).
        if (!mbar_wait(my_bar, parity, WaitBound{dc.claim, dc.timeout_ns}, kSiteCommRow) &&
            !mbar_drain(my_bar, parity, dev::globaltimer_ns() + dc.timeout_ns)) {
          slot_dead = true;
          return;
        }
        parity ^= 1u;
        staged = my_row;
      }
      bulk_store(to, staged, bytes);
      if (to_scales != nullptr) bulk_store(to_scales, staged + bytes, scale_bytes);  // (zeros: padding rows)
      tma_store_commit();  // its read of the slot is waited for before the slot's next load
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
        for (int32_t i0 = 0; i0 < n; i0 += cs.slots) {
          if (mover && i0 + t < n) move_row(cs.list[i0 + t]);
          if (p.mover_rounds) __syncthreads();
        }
        __syncthreads();  // the list is refilled next
      }
    } else {
#pragma unroll 1
      for (int32_t base = r.begin + first - t; base < r.end; base += stride) {
        if (mover && base + t < r.end) move_row(base + t);
        if (p.mover_rounds) __syncthreads();
      }
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

}  // namespace

}  // namespace mok::mk
