// mok — the forward megakernel's shared definitions (its tile configuration, wait ids and sites,
// the task slot handed from producer to consumers and its ring in shared memory). Private to the
// forward program: included by forward_kernel.cu and forward_comm.cuh only (one translation unit).
#pragma once

#include <cstdint>
#include <type_traits>

#include "comm/device.cuh"
#include "gemm/engine.cuh"
#include "gemm/engine_fp8.cuh"
#include "megakernel/forward_kernel.h"
#include "megakernel/forward_setup.h"
#include "megakernel/runtime.cuh"

namespace mok::mk {

namespace {

using namespace mok::gemm::engine;
// The program's operands: bf16 (forward_kernel.cu) or block-scaled E4M3 (forward_kernel_fp8.cu,
// which defines MOK_FORWARD_FP8 and compiles the same program: one translation unit per variant;
// forward_kernel_mxfp8.cu defines both).
#if defined(MOK_FORWARD_FP8)
using C = Cfg<256, OperandE4m3>;
#else
using C = Cfg<256>;
#endif
constexpr bool kFp8 = std::is_same_v<C::Operand, OperandE4m3>;
// MXFP8 (forward_kernel_mxfp8.cu): the FP8 program whose FC1 epilogue writes h as MXFP8 re-blocked
// to 1 x 128 (x and the weights come re-blocked from their quantizers: the same operands).
#if defined(MOK_FORWARD_MXFP8)
constexpr bool kMxH = true;
#else
constexpr bool kMxH = false;
#endif
static_assert(C::kBlockN == kForwardBlockN, "the host plan (forward_setup.h) and the kernel's tiles disagree");
namespace dev = mok::comm::dev;

// Three slots: the producer can publish task i+2 while the consumers finish task i's epilogue
// (measured equal to two slots without clusters; a prefetching producer that claimed task i+1
// during task i's loads measured 2% slower: its ticket atomic stalled the TMA thread mid-tile).
constexpr int kTaskSlots = kForwardTaskSlots;
constexpr int kStatWords = kForwardStatWords;
using StatClock = rt::StatClock<kStatWords>;
using rt::handoff_wait;
using rt::kSiteTaskSlot;
using rt::ld_acquire;
using rt::red_release;
using rt::wait_counter;
// Register split: the producer thread decodes tickets and waits on counters besides issuing TMA,
// which needs more than the plain engine's 40 registers; the consumers give up 8. With clusters
// the producer also stages and copies the partner's task slot (spills below 96); the consumers
// then fit in 200 without spills. The sum must stay within the CTA's allocation at launch
// (168 x 384 = 64512): 128 x 56 + 256 x 224 = 64512; 128 x 96 + 256 x 200 = 63488.
// FP8 fits the same split with m64n128 halves (a 64-register block accumulator beside the tile's
// 128) because its consumers keep no profile counters, no warpgroup stagger and no dummy flag
// across the mainloop (each cost spills; 40 / 232 spills instead in the comm CTAs' code, which
// ptxas allocates within the producer's budget).
template <bool kCluster>
constexpr uint32_t kMkProducerRegs = kCluster ? 96 : 56;
template <bool kCluster>
constexpr uint32_t kMkConsumerRegs = kCluster ? 200 : 224;
// Wait ids (names registered by the layer).
using rt::kWaitTaskDeps;  // "megakernel.task_dependency"
constexpr uint32_t kWaitCommDeps = comm::kWaitUserBase + 41;  // "megakernel.comm_dependency"
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

// Full: 1 arrival (the producer); empty: 256 (every consumer thread).
using TaskRing = rt::TaskRing<TaskSlot, kTaskSlots>;
using SlotCursor = rt::SlotCursor<kTaskSlots>;
// The consumers' task cursor: the FP8 program's in shared memory (consumer_cursor_words), whose
// consumers have no register left across the scaled mainloop.
using SlotCount = rt::SlotCount<kTaskSlots, kFp8>;
__device__ __forceinline__ TaskRing task_ring(uint8_t* smem_raw) {
  return TaskRing::at(smem_raw + C::kSmemBytes);  // after the engine's region (8-byte aligned)
}
// Clusters: rank 0 writes rank 1's task into a global slot of its cluster (ForwardParams::
// cluster_slots) and arrives on rank 1's `full` link (release.cluster); rank 1's follower producer
// (acquire.cluster) copies it into its own task ring, which its consumers read, and arrives on
// rank 0's `empty` link. compute-sanitizer's racecheck sees every shared-memory slot written and
// read inside one CTA, ordered by that CTA's own barriers (a slot written remotely with
// st.shared::cluster, as before, it reported as racing with the reads).
struct ClusterLinks {
  uint64_t* full;   // [kTaskSlots], rank 1's: the global slot holds its next task
  uint64_t* empty;  // [kTaskSlots], rank 0's: rank 1 has copied the global slot out
};
__device__ __forceinline__ ClusterLinks cluster_links(uint8_t* smem_raw) {
  auto* b = reinterpret_cast<uint64_t*>(smem_raw + C::kSmemBytes + TaskRing::kBytes);
  return {b, b + kTaskSlots};
}
// Task ring, its barriers, the cluster links, (FP8) a cursor word per consumer thread, then
// (clusters) the pair's abort word at the end.
constexpr int kCursorSmem = kFp8 ? 256 * 4 : 0;
constexpr int kExtraSmem = TaskRing::kBytes + 2 * kTaskSlots * 8 + kCursorSmem + 16;
__device__ __forceinline__ volatile uint32_t* consumer_cursor_words(uint8_t* smem_raw) {
  return reinterpret_cast<volatile uint32_t*>(smem_raw + C::kSmemBytes + TaskRing::kBytes + 2 * kTaskSlots * 8);
}
__device__ __forceinline__ uint32_t* abort_word(uint8_t* smem_raw) {
  return reinterpret_cast<uint32_t*>(smem_raw + C::kSmemBytes + kExtraSmem - 16);
}
static_assert(C::kSmemBytes % 16 == 0 && sizeof(TaskSlot) == kForwardTaskSlotBytes && TaskRing::kBytes % 8 == 0,
              "task ring alignment");

}  // namespace

}  // namespace mok::mk
