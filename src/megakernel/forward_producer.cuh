// mok — the forward megakernel's producer threads (compute CTAs): the wait for a task's
// dependencies, the task slot it fills, the ticket claim, and the producer / follower loops that
// hand tiles to the consumer warpgroups (forward_kernel.cu has the consumers and the kernel).
// Private to the forward program: included by forward_kernel.cu only.
#pragma once

#include <cstdint>

#include "megakernel/forward_common.cuh"

namespace mok::mk {

namespace {
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
  const int32_t kb1 = p.hidden / C::kBlockK;  // K blocks of the operand type (64 bf16, 128 FP8)
  if (tk.kind == kTaskFc1 || tk.kind == kTaskFc2) {
    const MbRows r = mb_rows(p.plan, total, tk.g);
    const int32_t ring_row = r.ring + m * sched::kBlockM - r.begin;
    const int32_t expert = p.schedule.tile_expert[m];
    // Token rows of this tile: the expert's segment holds expert_rows[e] tokens, then padding.
    s.rows = min(int32_t(sched::kBlockM),
                 p.schedule.expert_offset[expert] + p.schedule.expert_rows[expert] - m * sched::kBlockM);
    if (tk.kind == kTaskFc1) {
      s.tile = Tile{ring_row, b_n, expert, 0, kb1, C::kBlockK, ring_row, 0};
      s.gu_row = m * sched::kBlockM;
      s.counter = flags & kSlotDummy ? -1 : p.layout.fc1_done(m);
      s.n_cols = 2 * p.inter;
    } else {
      s.tile = Tile{ring_row, b_n, expert, 0, p.inter / C::kBlockK, C::kBlockK, ring_row, 0};
      s.gu_row = m * sched::kBlockM;  // the routed row (schedule index) of the tile's first row
      s.counter = flags & kSlotDummy ? -1 : p.layout.fc2_done(tk.g);
      s.n_cols = p.hidden;
    }
  } else {
    const int32_t row = m * sched::kBlockM;
    s.rows = min(int32_t(sched::kBlockM), p.tokens - row);
    if (tk.kind == kTaskShared1) {
      s.tile = Tile{row, b_n, 0, 0, kb1, C::kBlockK, row, 0};
      s.gu_row = row;
      s.counter = flags & kSlotDummy ? -1 : p.layout.s1_done(m);
      s.n_cols = 2 * p.shared_inter;
    } else {
      s.tile = Tile{row, b_n, 0, 0, p.shared_inter / C::kBlockK, C::kBlockK, row, 0};
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

// Operand maps of a task kind. FC2: `b_half` is the weight map with a box of BLOCK_N/2 rows (with
// clusters each CTA loads and multicasts half of a shared B tile); FC1 (gate_up): b and b_half
// are the gate and up weights (produce_tile reads B from both).
struct TaskMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* b_half;
  bool gate_up;
};
__device__ __forceinline__ TaskMaps task_maps(const ForwardMaps& maps, int32_t kind) {
  switch (kind) {
    case kTaskFc2:
      return TaskMaps{&maps.h_in, &maps.w_down, &maps.w_down_half, false};
    case kTaskShared1:
      return TaskMaps{&maps.xs_in, &maps.ws_gate, &maps.ws_up, true};
    case kTaskShared2:
      return TaskMaps{&maps.hs_in, &maps.ws_down, &maps.ws_down_half, false};
    default:
      return TaskMaps{&maps.x_ring, &maps.w_gate, &maps.w_up, true};
  }
}

// The cluster's global task slot `i` (ForwardParams::cluster_slots, 4 x 16 bytes).
__device__ __forceinline__ uint4* cluster_slot(const ForwardParams& p, uint32_t i) {
  return static_cast<uint4*>(p.cluster_slots) + (size_t(blockIdx.x / 2u) * kTaskSlots + i) * (sizeof(TaskSlot) / 16);
}

// Hands task tk to the consumers in the producer's next slot. Clusters (rank 0 only): the pair's
// second tile (or, for a one-tile unit, a dummy copy of the first) goes to the rank-1 CTA through
// the cluster's global slot of the same index (ClusterLinks: once rank 1 has copied the slot's
// previous task out, released at cluster scope). Returns rank 0's slot, or null when a slot never
// became free (never expected: a broken invariant): the slot is then left untouched, since the
// consumers may still be reading it, and the producer stops; the consumers end through their own
// bounded hand-off waits.
template <bool kCluster>
__device__ __forceinline__ TaskSlot* publish(const TaskRing& ring, const ClusterLinks& links, SlotCursor& c,
                                             const ForwardParams& p, int32_t total, Task tk, const WaitBound& wb) {
  if (!handoff_wait<false>(ring.empty + c.i, c.phase ^ 1u, wb)) return nullptr;
  // Clusters: acquire.cluster pairs with rank 1's release after it copied the global slot out.
  if (kCluster && !handoff_wait<true>(links.empty + c.i, c.phase ^ 1u, wb)) return nullptr;
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
    // Rank 1's tile, staged in our slot and copied to the global slot as 4 x 16 bytes; the
    // release.cluster arrival on rank 1's link orders the stores before it.
    fill_slot(*slot, p, total, tk, tk.tiles == 2 ? tk.m + 1 : tk.m, shared | (tk.tiles == 2 ? 0 : kSlotDummy));
    const uint4* v = reinterpret_cast<const uint4*>(slot);
    uint4* g = cluster_slot(p, c.i);
#pragma unroll
    for (uint32_t w = 0; w < sizeof(TaskSlot) / 16; ++w) g[w] = v[w];
    mbar_arrive_remote_release(links.full + c.i, 1u);
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
                         const Smem<C>& sm, const TaskRing& ring, const ClusterLinks& links, const WaitBound& wb) {
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
    const TaskSlot* slot = publish<kCluster>(ring, links, cur, p, total, tk, wb);
    if (slot == nullptr || tk.kind == kTaskEnd) break;
    dev::fence_proxy_async();  // the acquired rows are read by TMA next
    const TaskMaps tm = task_maps(maps, tk.kind);
    issuing = produce_tile<C, false, false, kCluster>(sm, ps, slot->tile, tm.a, tm.b, wb, tm.b_half,
                                                      (slot->flags & kSlotSharedB) != 0, 0u, tm.gate_up);
  }
  if (clock.out) clock.out[kStatDeps] = dep_ns;
  drain_stages(sm, ps, wb);
  if constexpr (kCluster) producer_tail(sm, ps, wb);
}

// Producer thread of a cluster's rank-1 CTA: takes its tiles from the cluster's global slots
// (written by rank 0, which did the dependency waits; its cluster-scope release orders them before
// our acquire), copies each into its own task ring for its consumers, frees the global slot, and
// issues its loads: its A tile, and its half of a shared B tile or its own B. Once a load wait
// gives up (some wait on the GPU expired) it hands its consumers an End and, issuing nothing more,
// keeps freeing rank 0's slots until rank 0's End, so that neither CTA waits for the other; when
// a hand-off wait itself expires (never expected) its consumers get an End too.
__device__ void follower_producer(const ForwardMaps& maps, const ForwardParams& p, const Smem<C>& sm,
                                  const TaskRing& ring, const ClusterLinks& links, const WaitBound& wb) {
  PipeState<C> ps;
  SlotCursor cur;
  bool issuing = true, consumers_ended = false;
#pragma unroll 1
  for (;;) {
    const bool got = handoff_wait<true>(links.full + cur.i, cur.phase, wb);  // false: never expected
    const uint4* g = cluster_slot(p, cur.i);
    const int32_t kind = got ? __ldcg(reinterpret_cast<const int32_t*>(g) + offsetof(TaskSlot, kind) / 4) : kTaskEnd;
    bool handed = false;  // a task of rank 0's went to our consumers: load its operands
    Tile t{};
    bool shared = false;
    if (!consumers_ended) {
      if (handoff_wait<false>(ring.empty + cur.i, cur.phase ^ 1u, wb)) {  // our consumers' slot
        TaskSlot& slot = ring.slot[cur.i];
        if (got && issuing) {
          uint4* v = reinterpret_cast<uint4*>(&slot);
#pragma unroll
          for (uint32_t w = 0; w < sizeof(TaskSlot) / 16; ++w) v[w] = __ldcg(g + w);  // L2: not a stale L1 line
        } else {
          slot.kind = kTaskEnd;
        }
        mbar_arrive(ring.full + cur.i);  // release (CTA scope): the slot's contents to our consumers
        handed = slot.kind != kTaskEnd;
        consumers_ended = !handed;
        t = slot.tile;
        shared = (slot.flags & kSlotSharedB) != 0;
      } else {
        consumers_ended = true;  // (never expected) they end through their own bounded waits
        issuing = false;
      }
    }
    if (got) mbar_arrive_remote_release(links.empty + cur.i, 0u);  // rank 0 may write the slot again
    cur.advance();
    if (!got || kind == kTaskEnd) break;  // rank 0's End (or it stopped handing over)
    if (!handed || !issuing) continue;    // draining rank 0's slots: no loads
    dev::fence_proxy_async();  // rows acquired (through rank 0) are read by TMA next
    const TaskMaps tm = task_maps(maps, kind);
    if (!produce_tile<C, false, false, true>(sm, ps, t, tm.a, tm.b, wb, tm.b_half, shared, 1u, tm.gate_up))
      issuing = false;  // a wait expired: End to our consumers next, then drain
  }
  drain_stages(sm, ps, wb);
  producer_tail(sm, ps, wb);
}

}  // namespace

}  // namespace mok::mk
