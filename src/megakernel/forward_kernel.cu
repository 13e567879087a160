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
//     producer claims and waits for both, hands rank 1 its tile through a global slot of the
//     cluster (rank 1's follower copies it into its own task ring), and the two CTAs share
//     (multicast) the weight tile when both rows use one expert.
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
#include <cstddef>

#include "common/cuda_check.h"
#include "megakernel/forward_comm.cuh"
#include "megakernel/forward_common.cuh"
#include "megakernel/forward_producer.cuh"
#include "mok/errors.hpp"

namespace mok::mk {

static_assert(kWaitSites[0].code == kSiteProducerEmpty && kWaitSites[1].code == kSiteConsumerFull &&
                  kWaitSites[2].code == kSiteSkew && kWaitSites[3].code == rt::kSiteTaskSlot &&
                  kWaitSites[4].code == kSiteCommRow,
              "forward_kernel.h's wait-site names must follow the codes");

namespace {

// ------------------------------------------------------------------------------------------------
// Compute CTAs: producers in forward_producer.cuh; the consumer warpgroups below
// ------------------------------------------------------------------------------------------------
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
// multicast into it); a dummy tile is computed but neither stored nor reported; each CTA's task
// slots are its own (rank 1's filled by its follower producer from rank 0's global slots).
template <bool kCluster>
__device__ void consumer(const ForwardMaps& maps, const ForwardParams& p, const Smem<C>& sm, const TaskRing& ring,
                         const WaitBound& wb, uint32_t rank, volatile uint32_t* cursor_words) {
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
  SlotCount cur;  // the task ring's position (FP8: in this thread's shared-memory word)
  cur.init(cursor_words + ct);
  // (FP8: no profile words from the consumers — their 16 registers of counters are what the scaled
  // mainloop's block accumulator needs; a constant null clock compiles them out.)
  const StatClock clock(!kFp8 && leader && cwg == 0 ? p.stats : nullptr);
  uint64_t busy_ns = 0, wait_ns = 0, tiles = 0, start_ns = 0, epi_ns = 0, fc2_ns = 0, fc2_tiles = 0, mc_tiles = 0;
  const uint64_t c0 = clock.out ? clock64() : 0;
  // Other GPUs read our counters only to reuse ring rows under push dispatch (see report()).
  const bool sys_reports =
      p.push_dispatch && num_positions(p.plan, p.schedule.totals->total_rows) > ring_slots(p.plan);
#pragma unroll 1
  for (;;) {
    const uint64_t w0 = clock.now();
    if (leader && pending >= 0 && !mbar_test(ring.full + cur.i(), cur.phase())) report(p, pending, sys_reports);
    // Every thread waits, then a barrier-and makes the warpgroup agree: an expiry seen by some
    // threads only would split the warpgroup at its next wgmma or barrier (an unbounded hang).
    const bool got =
        named_bar_and(kBarEpilogue + uint32_t(cwg), 128, handoff_wait<false>(ring.full + cur.i(), cur.phase(), wb));
    const uint64_t w1 = clock.now();
    wait_ns += w1 - w0;
    // The slot is read in place (fewer live registers next to the accumulators) and released
    // after the epilogue; the producer meanwhile fills the next slot.
    const TaskSlot& slot = ring.slot[cur.i()];
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
    // (Only clusters hand out dummy tiles: without them the flag is known false, and is not kept
    // in a register across the mainloop.)
    const bool dummy = kCluster && (slot.flags & kSlotDummy) != 0;
    if constexpr (kFp8) {
      // Block-scaled FP8 (routed tasks only: the FP8 layer has no shared expert): whole tiles with
      // the scaled mainloop, then FC1's FP8 epilogue (h codes and scales into the h ring) or
      // FC2's bf16 one. The scaled mainloop has no first-block hook: report before it. Its MMAs
      // are m64n128 halves (a 64-register block accumulator beside the tile's 128): m64n64
      // quarters read A from shared memory once per 64 columns, which at FP8's rate is as much
      // shared-memory traffic as the tensor cores can take. No warpgroup stagger here (its
      // barrier state did not fit beside the halves, and it measured no gain with quarters).
      if (leader) report(p, pending, sys_reports);
      const Tile& t = slot.tile;
      if (kind == kTaskFc1) {
        const int64_t kb = t.k_blocks;  // H / 128
        const int64_t wblock = (int64_t(t.b_batch) * (p.inter / 128) + t.b_n / 256) * kb;
        TileScales sc{p.x_scales_ring + int64_t(t.a_m) * kb, kb, p.w_gate_scales + wblock, 0, 1};
        sc.b_up = p.w_up_scales + wblock;
        mma_tile_scaled<C, BScale::GateUp>(sm, ps, t, cwg, wt, acc, wb, sc);
        e0 = clock.now();
        if (!dummy) {
          // The activation budget's gate/up rows (a backward over windows reads them): the tile's
          // rnd(g), rnd(u) in the packed order through maps.gu, whose end clips the rows past the
          // budget, as the bf16 program's FC1 stores them (and the grouped FP8 FC1's gu: the same
          // bits). Staged through shared memory: stores from the registers cost the consumers
          // registers they do not have; the row is a volatile read of the slot, which the
          // compiler does not hoist above the mainloop (ptxas spilled otherwise).
          if (p.save_gu)
            epilogue_store<C>(sm, es, cwg, wt, acc, &maps.gu,
                              *reinterpret_cast<const volatile int32_t*>(&slot.gu_row), t.b_n, 2 * p.inter);
          epilogue_fc1_fp8<kMxH>(acc, cwg, wt, t.out_row, t.b_n, static_cast<uint8_t*>(p.h_ring), p.h_scales_ring,
                                 p.inter);
        }
      } else {
        const int64_t kb = t.k_blocks, n_blocks = p.hidden / 128;  // I / 128; H / 128
        const TileScales sc{p.h_scales_ring + int64_t(t.a_m) * kb, kb,
                            p.w_down_scales + (int64_t(t.b_batch) * n_blocks + t.b_n / 128) * kb, kb,
                            int32_t(n_blocks - t.b_n / 128)};
        mma_tile_scaled<C, BScale::Block>(sm, ps, t, cwg, wt, acc, wb, sc);
        e0 = clock.now();
        if (dummy) {
        } else if (combine) {
          epilogue_combine(p, sm, es, cwg, wt, acc, slot.gu_row, t.b_n);
        } else {
          epilogue_store<C>(sm, es, cwg, wt, acc, &maps.y_out, t.out_row, t.b_n, slot.n_cols);
        }
      }
    } else if (half && p.split_n && !combine) {
      // Tokens only in rows 0..63: both warpgroups on those rows, each on half of the columns.
      mma_tile_split_n<C, kCluster>(sm, ps, slot.tile, cwg, acc, wb, peer, report_previous);
      e0 = clock.now();
      const Tile& t = slot.tile;
      if (dummy) {
      } else if (kind == kTaskFc1 || kind == kTaskShared1) {
        const bool routed = kind == kTaskFc1;
        const CUtensorMap* gu_map =
            routed ? (p.save_gu ? &maps.gu : nullptr) : (p.save_gu_shared ? &maps.gus_out : nullptr);
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
        const CUtensorMap* gu_map =
            routed ? (p.save_gu ? &maps.gu : nullptr) : (p.save_gu_shared ? &maps.gus_out : nullptr);
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
    mbar_arrive(ring.empty + cur.i());  // both ranks: the slot is this CTA's own
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
  const ClusterLinks links = cluster_links(smem_raw);
  const Smem<C> sm = smem_view<C>(smem_raw);
  const WaitBound wb{dc.claim, dc.timeout_ns};
  rt::run_cta<C, kTaskSlots, kCluster, kMkProducerRegs<kCluster>, kMkConsumerRegs<kCluster>>(
      p.plan.comm_ctas, dc, sm, ring.full, ring.empty, abort_word(smem_raw),
      [&] { comm_cta(p, dc, smem_raw, uint32_t(C::kSmemBytes) + uint32_t(kExtraSmem)); },
      [&] { producer<kCluster>(maps, p, dc, sm, ring, links, wb); },
      [&] { follower_producer(maps, p, sm, ring, links, wb); },
      [&](uint32_t rank) { consumer<kCluster>(maps, p, sm, ring, wb, rank, consumer_cursor_words(smem_raw)); }, links.full,
      kCluster ? 2 * kTaskSlots : 0);
}

}  // namespace

static_assert(C::kSmemBytes + kExtraSmem <= 232448, "the megakernel's shared memory exceeds 227 KB");

// The exported functions: mk:: for the bf16 program, mk::fp8:: / mk::mxfp8:: for the FP8 ones.
#if defined(MOK_FORWARD_MXFP8)
namespace mxfp8 {
#elif defined(MOK_FORWARD_FP8)
namespace fp8 {
#endif

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
  MOK_REQUIRE(!kFp8 || !cluster, "config.fwd_clusters", "must be off with config.precision fp8 (2-CTA clusters are "
              "bf16 only so far)");
  bool paired = false;
#if !defined(MOK_FORWARD_FP8)  // (the FP8 program has no cluster variant: not even compiled)
  {
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
      paired = true;
    }
  }
#endif
  if (!paired) {
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
  MOK_REQUIRE(!params.cluster || params.cluster_slots != nullptr, "megakernel parameters",
              "cluster_slots must be given with clusters (forward_cluster_slot_bytes(grid) bytes)");
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, params.cluster != 0, stream, attr);
#if defined(MOK_FORWARD_FP8)
  MOK_REQUIRE(!params.cluster, "megakernel parameters", "no 2-CTA clusters with FP8 operands");
  MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, forward_megakernel<false>, maps, params, dc));
#else
  if (params.cluster)
    MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, forward_megakernel<true>, maps, params, dc));
  else
    MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, forward_megakernel<false>, maps, params, dc));
#endif
}

#if defined(MOK_FORWARD_FP8)
}  // namespace fp8 / mxfp8
#endif

}  // namespace mok::mk
