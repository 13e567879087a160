// mok — the SM90 tile engine, part 1: operand types, configuration, shared-memory layout, the
// producer and the consumers' mainloop (the epilogues are in engine_epilogue.cuh; engine.cuh
// includes both). Warp-specialized, TMA-fed, wgmma-based, persistent.
//
// Operand type (the policy a Cfg carries): every stage row is 128 bytes of K (one 128B-swizzle
// row), so the tile bytes, TMA boxes, swizzle and wgmma descriptors are the same for every type;
// what differs is how many K elements that is (kBlockK: 64 bf16 or 128 FP8), the wgmma per 32-byte
// K step (k16 bf16 or k32 e4m3) and whether operands may be MN-major (bf16 only: the ISA has no
// transpose for FP8). The epilogues are the output's business (fp32 accumulators either way).
//
// Roles inside one CTA of 384 threads (3 warpgroups):
//   * warpgroup 0 = producer: drops to kProducerRegs registers; one elected thread of its first
//     warp issues the TMA loads of every K block into a kStages-deep ring of shared-memory stages
//     (full barrier: 1 arrival + the stage's bytes; empty barrier: one arrival per consumer warp);
//   * warpgroups 1 and 2 = consumers: raise to kConsumerRegs registers; each owns 64 rows of the
//     128-row tile and all BLOCK_N (256, or 128 for small problems) columns (m64nNk16 wgmma, N/2
//     fp32 accumulators per thread), keeps
//     one wgmma group in flight (a stage is released when the next one's group was issued), then
//     runs the epilogue: accumulators -> bf16 (stmatrix into a 128B-swizzled 64x64 chunk buffer,
//     two buffers per warpgroup) -> TMA store, overlapping the next chunk and the next tile.
// Producer and consumers walk the same tile sequence (a Schedule with a deterministic next()),
// so the pipeline needs no other coordination. The pieces (produce_tile, mma_tile, the epilogue
// helpers) are device functions over an Smem view, a PipeState and a Tile: a megakernel that owns
// its own task list calls them directly (see notes/gemm.md, "Using the engine in a megakernel").
//
// Named barriers used: 1 + consumer warpgroup index (epilogue, 128 threads), 3 (both consumer
// warpgroups, 256 threads; only for K-masked tiles).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "gemm/sm90.cuh"
#include "mok/gemm_sizes.hpp"  // engine_smem_bytes

namespace mok::gemm::engine {

using namespace mok::gemm::sm90;

inline constexpr int kBlockM = 128;
inline constexpr int kKBytes = 128;  // K bytes per stage row: one 128B-swizzle row
inline constexpr int kThreads = 384;
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
inline constexpr uint32_t kATileBytes = kBlockM * kKBytes;  // 16 KB
inline constexpr uint32_t kChunkBytes = 64 * 64 * 2;  // 8 KB: [64 rows][64 bf16], 128B-swizzled

// The operand types. kBlockK: K elements per stage; kStepK: per wgmma (one 32-byte step of the
// descriptors); mma: the wgmma of an m64nN tile (N/2 fp32 accumulators per thread).
struct OperandBf16 {
  static constexpr int kElemBytes = 2;
  static constexpr int kBlockK = kKBytes / kElemBytes;  // 64
  static constexpr int kStepK = 16;
  static constexpr bool kMNMajor = true;  // either operand may be MN-major (transposed)
  template <int N, bool kAMN, bool kBMN>
  __device__ __forceinline__ static void mma(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t scale_d) {
    wgmma_bf16<N, kAMN ? 1 : 0, kBMN ? 1 : 0>(d, da, db, scale_d);
  }
};
struct OperandE4m3 {
  static constexpr int kElemBytes = 1;
  static constexpr int kBlockK = kKBytes / kElemBytes;  // 128
  static constexpr int kStepK = 32;
  static constexpr bool kMNMajor = false;  // K-major A and B only
  template <int N, bool kAMN, bool kBMN>
  __device__ __forceinline__ static void mma(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t scale_d) {
    static_assert(!kAMN && !kBMN, "FP8 wgmma reads K-major operands only");
    wgmma_e4m3<N>(d, da, db, scale_d);
  }
};

// K elements per stage of the bf16 instance: the K block every bf16 form, schedule and megakernel
// task counts in.
inline constexpr int kBlockK = OperandBf16::kBlockK;

// Tile configuration: BLOCK_N = 256 (the default: 128 accumulators per consumer thread, 4 stages
// of 48 KB) or 128 (problems with too few 256-wide tiles to fill the GPU: 64 accumulators, 6
// stages of 32 KB); the operand type (bf16 by default). kScaleFloats (the FP8 wgrad): fp32 scales
// that travel with each stage (loaded by the producer beside its operands, in an area of whole
// KBs per stage), at the price of one stage (5 or 3).
template <int kBN, class Op = OperandBf16, int kScaleFloats = 0>
struct Cfg {
  static_assert(kBN == 256 || kBN == 128, "BLOCK_N is 256 or 128");
  static_assert(kScaleFloats >= 0 && kScaleFloats <= 512, "at most 2 KB of scales per stage");
  using Operand = Op;
  static constexpr int kBlockK = Op::kBlockK;
  static_assert(kBlockK * Op::kElemBytes == kKBytes && kBlockK / Op::kStepK == 4,
                "a stage row is 128 bytes of K, four 32-byte wgmma steps");
  static constexpr int kBlockN = kBN;
  static constexpr int kStages = (kBN == 256 ? 4 : 6) - (kScaleFloats > 0 ? 1 : 0);
  static constexpr int kAccRegs = kBN / 2;  // m64nN fp32 accumulators per thread
  static constexpr int kChunks = kBN / 64;  // 64-column chunks of the output / MN-major B tile
  static constexpr uint32_t kBTileBytes = uint32_t(kBN) * kKBytes;
  static constexpr uint32_t kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kStageScales = kScaleFloats;
  static constexpr uint32_t kScaleAreaBytes = (uint32_t(kScaleFloats) * 4u + 1023u) / 1024u * 1024u;
  static constexpr uint32_t kScaleOffset = kStages * kStageBytes;  // kStages areas (if any)
  static constexpr uint32_t kEpiOffset = kScaleOffset + kStages * kScaleAreaBytes;
  static constexpr uint32_t kBarOffset = kEpiOffset + 4 * kChunkBytes;
  static constexpr uint32_t kNumBars = 2 * kStages + 2;  // full[], empty[], skew[2]
  static constexpr uint32_t kSmemBytes = kBarOffset + kNumBars * 8 + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 232448, "exceeds the 227 KB of shared memory a CTA may use");
  static_assert(kScaleFloats > 0 || kSmemBytes == uint32_t(engine_smem_bytes(kBN)),
                "mok/gemm_sizes.hpp's engine_smem_bytes (gemm::smem_bytes) must be this sum");
};

inline constexpr uint32_t kBarEpilogue = 1;   // + consumer warpgroup index
inline constexpr uint32_t kBarConsumers = 3;  // both consumer warpgroups

// Wait sites recorded in the error word when a bounded wait expires.
inline constexpr unsigned int kSiteProducerEmpty = 0x6e01;
inline constexpr unsigned int kSiteConsumerFull = 0x6e02;
inline constexpr unsigned int kSiteSkew = 0x6e03;

// View of the engine's shared memory (base 1024-byte aligned).
template <class C>
struct Smem {
  uint8_t* base;
  __device__ uint8_t* a(uint32_t s) const { return base + s * kATileBytes; }
  __device__ uint8_t* b(uint32_t s) const { return base + C::kStages * kATileBytes + s * C::kBTileBytes; }
  // Stage s's scales (Cfg::kStageScales floats; 1 KB aligned).
  __device__ float* scales(uint32_t s) const {
    return reinterpret_cast<float*>(base + C::kScaleOffset + s * C::kScaleAreaBytes);
  }
  __device__ uint8_t* epi(int cwg, uint32_t buf) const {
    return base + C::kEpiOffset + (uint32_t(cwg) * 2u + buf) * kChunkBytes;
  }
  __device__ uint64_t* full(uint32_t s) const {
    return reinterpret_cast<uint64_t*>(base + C::kBarOffset) + s;
  }
  __device__ uint64_t* empty(uint32_t s) const {
    return reinterpret_cast<uint64_t*>(base + C::kBarOffset) + C::kStages + s;
  }
  // Two barriers (alternating per tile) that stagger the consumer warpgroups (see Skew).
  __device__ uint64_t* skew(uint32_t i) const {
    return reinterpret_cast<uint64_t*>(base + C::kBarOffset) + 2 * C::kStages + i;
  }
};

template <class C>
__device__ __forceinline__ Smem<C> smem_view(uint8_t* raw) {
  const uintptr_t p = (reinterpret_cast<uintptr_t>(raw) + 1023u) & ~uintptr_t(1023u);
  return Smem<C>{reinterpret_cast<uint8_t*>(p)};
}

// One thread initialises the ring's barriers; a CTA-wide barrier must follow.
// With 2-CTA clusters every stage is released by the consumer warps of both CTAs (16 arrivals):
// a multicast B load writes into the partner's stage too.
template <class C>
__device__ __forceinline__ void init_barriers(const Smem<C>& sm, uint32_t cluster_size = 1) {
  for (uint32_t s = 0; s < uint32_t(C::kStages); ++s) {
    mbar_init(sm.full(s), 1);
    mbar_init(sm.empty(s), 8 * cluster_size);  // one arrival per consumer warp of the cluster
  }
  mbar_init(sm.skew(0), 1);
  mbar_init(sm.skew(1), 1);
  mbar_fence_init();
}

template <class C>
struct PipeState {
  uint32_t stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == uint32_t(C::kStages)) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// One output tile of kBlockM x kBlockN.
struct Tile {
  int32_t a_m;           // A coordinate along M (K-major A: routed row; MN-major A: column)
  int32_t b_n;           // first output column (B coordinate along N)
  int32_t b_batch;       // B's outer coordinate (expert of a [E, ., .] weight map)
  int32_t k_begin;       // first K coordinate
  int32_t k_blocks;      // K blocks of Cfg::kBlockK (0: the tile is zero)
  int32_t k_last_valid;  // valid K rows of the last block (kBlockK unless the tile is K-masked)
  int32_t out_row;       // output row of the tile's first row
  int32_t out_batch;     // output outer coordinate (3-D output maps)
};

// Hook of mma_tile and its variants (a megakernel's callback at a fixed point of a tile); none by default.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// What produce_tile loads into a stage besides A and B (none by default): bytes() more on the
// stage's full barrier, issued by operator()(stage, K block, barrier) (the FP8 wgrad's scales).
struct NoStageExtra {
  __device__ __forceinline__ uint32_t bytes() const { return 0; }
  __device__ __forceinline__ void operator()(uint32_t, int, uint64_t*) const {}
};

// Held rows (the bf16 weight gradient, KernelParams::hold): a tile's K coordinates k < 0 read A
// and B from these maps at rows k + a_row / k + b_row instead (rows an earlier call kept aside:
// schedule_math.h's WindowHold). a == nullptr: none.
struct HoldMaps {
  const CUtensorMap* a = nullptr;
  const CUtensorMap* b = nullptr;
  int32_t a_row = 0, b_row = 0;
};

// ------------------------------------------------------------------------------------------------
// Producer (one thread)
// ------------------------------------------------------------------------------------------------
// A maps: K-major 2-D {K, rows} with box {64, 128}; MN-major 2-D {M, K rows} with box {64, 64}.
// B maps: K-major 3-D {K, N, batch} with box {64, BLOCK_N, 1}; MN-major 3-D {N, K, batch} with box
// {64, 64, 1}.
// Clusters (kCluster): when the tile's B is `shared` with the partner CTA (same expert and
// columns, the other 128 rows), this CTA loads half of B (rows or chunks of its `rank`) and
// multicasts it to both CTAs; map_b_half is the K-major B map with a box of BLOCK_N/2 rows.
// Gate/up B (`gate_up`: FC1, and FC1's dgrad): B is [W_gate; W_up] in the packed order of
// mok/gemm.hpp, read from the two weights where they are: map_b is W_gate's map and map_b_half
// W_up's, both with boxes of 32 rows (kGateUpBox) of the intermediate dimension. K-major (FC1): the
// tile's BLOCK_N packed rows are BLOCK_N/32 boxes, alternately gate and up; MN-major (the dgrad:
// K is the packed dimension): each 64-row K block is 32 gate rows then 32 up rows of every chunk.
// A 32-row box is 4 KB, a multiple of the 128B swizzle's 1 KB atom, so the shared tile is
// byte-identical to one box of the packed tensor.
// Returns false (nothing more issued, the stage not armed) when a wait for a free stage expired:
// the producer must then stop, so that each stage has at most one load in flight and
// drain_stages can wait for exactly those.
constexpr int kGateUpBox = 32;  // rows of a gate or up box (mok::gemm::kGateUpGroup)
constexpr int kGateUpBoxBytes = kGateUpBox * 128;
template <class C, bool kAMN, bool kBMN, bool kCluster = false, class Extra = NoStageExtra>
__device__ __forceinline__ bool produce_tile(const Smem<C>& sm, PipeState<C>& ps, const Tile& t,
                                             const CUtensorMap* map_a, const CUtensorMap* map_b,
                                             const WaitBound& wb, const CUtensorMap* map_b_half = nullptr,
                                             bool shared = false, uint32_t rank = 0, bool gate_up = false,
                                             const Extra& extra = Extra{}, HoldMaps hold = {}) {
  const bool multicast = kCluster && shared;
  const CUtensorMap* const main_a = map_a;
  const CUtensorMap* const main_b = map_b;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    if (!mbar_wait(sm.empty(ps.stage), ps.phase ^ 1u, wb, kSiteProducerEmpty)) return false;
    uint64_t* full = sm.full(ps.stage);
    mbar_arrive_expect_tx(full, C::kStageBytes + extra.bytes());
    extra(ps.stage, kb, full);
    // k: B's K coordinate, k_a: A's. A held K block (k < 0; whole blocks, held rows being whole
    // 128-row tiles) comes from the hold maps, at rows of their own.
    int32_t k = t.k_begin + kb * C::kBlockK, k_a = k;
    map_a = main_a;
    map_b = main_b;
    if (hold.a != nullptr && k < 0) {
      map_a = hold.a;
      map_b = hold.b;
      k_a = k + hold.a_row;
      k += hold.b_row;
    }
    uint8_t* a = sm.a(ps.stage);
    uint8_t* b = sm.b(ps.stage);
    if constexpr (!kAMN) {
      tma_load_2d(a, map_a, full, k_a, t.a_m);
    } else {
      tma_load_2d(a, map_a, full, t.a_m, k_a);
      tma_load_2d(a + kChunkBytes, map_a, full, t.a_m + 64, k_a);
    }
    // One box of B into the tile at byte `off`, multicast to both CTAs when shared.
    const auto load_b = [&](uint32_t off, const CUtensorMap* map, int32_t c0, int32_t c1) {
      if (multicast)
        tma_load_3d_multicast(b + off, map, full, c0, c1, t.b_batch, 0x3);
      else
        tma_load_3d(b + off, map, full, c0, c1, t.b_batch);
    };
    if (gate_up) {
      // Boxes (K-major) or chunks (MN-major) of this CTA: all, or its rank's half when multicast.
      if constexpr (!kBMN) {
        constexpr int kBoxes = C::kBlockN / kGateUpBox;  // alternately gate and up
#pragma unroll
        for (int s = 0; s < kBoxes; ++s)
          if (!multicast || uint32_t(s / (kBoxes / 2)) == rank)
            load_b(uint32_t(s) * kGateUpBoxBytes, (s & 1) ? map_b_half : map_b, k, t.b_n / 2 + kGateUpBox * (s >> 1));
      } else {
#pragma unroll
        for (int c = 0; c < C::kChunks; ++c)
          if (!multicast || uint32_t(c / (C::kChunks / 2)) == rank) {
            load_b(uint32_t(c) * kChunkBytes, map_b, t.b_n + 64 * c, k / 2);
            load_b(uint32_t(c) * kChunkBytes + kGateUpBoxBytes, map_b_half, t.b_n + 64 * c, k / 2);
          }
      }
    } else if (multicast) {
      if constexpr (!kBMN) {
        load_b(rank * (C::kBTileBytes / 2), map_b_half, k, t.b_n + int32_t(rank) * (C::kBlockN / 2));
      } else {
#pragma unroll
        for (int h = 0; h < C::kChunks / 2; ++h) {
          const int c = int(rank) * (C::kChunks / 2) + h;
          load_b(uint32_t(c) * kChunkBytes, map_b, t.b_n + 64 * c, k);
        }
      }
    } else if constexpr (!kBMN) {
      load_b(0, map_b, k, t.b_n);
    } else {
#pragma unroll
      for (int c = 0; c < C::kChunks; ++c) load_b(uint32_t(c) * kChunkBytes, map_b, t.b_n + 64 * c, k);
    }
    ps.advance();
  }
  return true;
}

// Producer, before the CTA exits: wait until the loads of the last kStages issues (one per stage,
// never-armed stages pass at once) have landed: in a normal run a few µs for the last loads (the
// consumers wait for them anyway); after an expired wait the consumers stop early, and without
// this a TMA load or a partner's multicast could still write into the shared memory of an exited
// CTA. Exact because produce_tile stops at the first expired wait (one load in flight per stage).
// One deadline for all stages (a timeout-free run has no bound: 10 s then).
template <class C>
__device__ __forceinline__ void drain_stages(const Smem<C>& sm, const PipeState<C>& ps, const WaitBound& wb) {
  const uint64_t deadline = global_timer_ns() + (wb.limit_ns ? wb.limit_ns : 10000000000ull);
  for (uint32_t j = 1; j <= uint32_t(C::kStages); ++j) {
    const bool wrapped = ps.stage < j;  // issue ps - j was in the previous round of the ring
    const uint32_t s = wrapped ? ps.stage + uint32_t(C::kStages) - j : ps.stage - j;
    if (!mbar_drain(sm.full(s), wrapped ? ps.phase ^ 1u : ps.phase, deadline)) return;
  }
}

// Clusters: before the CTA exits, wait until every stage's last use was released by the consumers
// of both CTAs, so no remote arrival or multicast targets a CTA that has exited.
template <class C>
__device__ __forceinline__ void producer_tail(const Smem<C>& sm, PipeState<C>& ps, const WaitBound& wb) {
  for (int i = 0; i < C::kStages; ++i) {
    mbar_wait(sm.empty(ps.stage), ps.phase ^ 1u, wb, kSiteProducerEmpty);
    ps.advance();
  }
}

// ------------------------------------------------------------------------------------------------
// Consumer mainloop (one warpgroup; cwg = 0 or 1 picks rows 0..63 or 64..127 of the tile)
// ------------------------------------------------------------------------------------------------
template <class C, bool kCluster = false>
__device__ __forceinline__ void release_stage(const Smem<C>& sm, uint32_t s, uint32_t peer = 0) {
  const uint32_t lane = lane_id();
  if (lane == 0) mbar_arrive(sm.empty(s));
  if constexpr (kCluster) {
    if (lane == 1) mbar_arrive_remote(sm.empty(s), peer);  // another lane: no serial fence chain
  }
}

// Zeroes K rows [valid, end) of both operands of stage s (MN-major A and B only): rows past an
// expert's last token are padding whose contents are unspecified (possibly NaN); rows from `end`
// on are not read (mma_tile issues only the K steps below it). Called by all 256 consumer threads
// (ct = 0..255).
template <class C>
__device__ __forceinline__ void mask_k_rows(const Smem<C>& sm, uint32_t s, int valid, int end_rows, uint32_t ct) {
  static_assert(C::Operand::kMNMajor, "K masking is of MN-major stages (128-byte rows of 64 bf16)");
  // Rows [valid, end) of a chunk are one contiguous run of 16-byte units (128-byte rows; the swizzle
  // permutes units inside a row only), so each chunk's run is a strided loop without the division
  // per unit the flat loop over all chunks needed (with the bf16 decode on reciprocal divisors,
  // the layer's backward 0.981x at DeepSeek-V3, where almost every expert's last K block is
  // partial: notes/gemm.md).
  const uint32_t first = uint32_t(valid) * 8u, end = uint32_t(end_rows) * 8u;  // 16-byte units
#pragma unroll
  for (int chunk = 0; chunk < 2 + C::kChunks; ++chunk) {  // 2 A chunks + the B chunks
    uint8_t* base = chunk < 2 ? sm.a(s) + chunk * kChunkBytes : sm.b(s) + (chunk - 2) * kChunkBytes;
    for (uint32_t u = first + ct; u < end; u += 256u)
      *reinterpret_cast<uint4*>(base + u * 16u) = make_uint4(0u, 0u, 0u, 0u);
  }
  fence_async_shared();
  named_bar_sync(kBarConsumers, 256);
}

// Optional stagger of the two consumer warpgroups: warpgroup 1 starts a tile only after warpgroup
// 0 has issued its first `stages` K blocks of it, so their epilogues (which leave the tensor cores
// idle when both run them at once) overlap the other warpgroup's MMAs. Warpgroup 0 can run at most
// kStages blocks ahead (the ring), so with stages <= kStages and tiles longer than kStages +
// stages blocks neither waits on the other in a cycle, and a barrier never completes twice before
// it is waited on (two barriers alternate per tile). Tiles too short for that are not staggered.
template <class C>
struct Skew {
  int32_t stages = 0;  // 0: off
  uint32_t tiles = 0;  // staggered tiles so far (same count in both warpgroups)
  __device__ bool applies(const Tile& t) const {
    return stages > 0 && stages <= C::kStages && t.k_blocks > C::kStages + stages;
  }
};

// The first kSteps K steps (32 bytes of K each) of a stage as one committed group of wgmmas, with
// the fence that orders the accumulators' register writes before them; `more`: the accumulators
// already hold sums (scale-d 1 from the first step on). A full stage computes each step's
// descriptors between the wgmmas, as every form did before the short runs existed: with them all
// computed before the fence (the runs' form) the bf16 wgrad was 0.2-0.6% slower at 256 rows per
// expert and 2.3-2.5% at 260 (one H100, bench/results/wgrad-last-block-ab-h100x1.json; unchanged
// code in the same runs spread +-2%). A short run (an expert's K-masked last
// block) computes its descriptors and first scale before the fence: there a register the wgmmas
// read that is written after it made ptxas inject another warpgroup.arrive (C7519). The commit is
// inside both: after the join of mma_tile's branches ptxas injected an arrive there too.
template <class C, bool kAMN, bool kBMN, int kSteps>
__device__ __forceinline__ void mma_k_steps(float (&acc)[C::kAccRegs], uint32_t as, uint32_t bs, bool more) {
  if constexpr (kSteps == C::kBlockK / C::Operand::kStepK) {
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < kSteps; ++k16) {
      const uint64_t da = kAMN ? desc_mn_major(as, k16, kChunkBytes) : desc_k_major(as, k16);
      const uint64_t db = kBMN ? desc_mn_major(bs, k16, kChunkBytes) : desc_k_major(bs, k16);
      C::Operand::template mma<C::kBlockN, kAMN, kBMN>(acc, da, db, (more || k16 > 0) ? 1u : 0u);
    }
  } else {
    uint64_t da[kSteps], db[kSteps];
#pragma unroll
    for (int k16 = 0; k16 < kSteps; ++k16) {
      da[k16] = kAMN ? desc_mn_major(as, k16, kChunkBytes) : desc_k_major(as, k16);
      db[k16] = kBMN ? desc_mn_major(bs, k16, kChunkBytes) : desc_k_major(bs, k16);
    }
    const uint32_t first_scale = more ? 1u : 0u;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < kSteps; ++k16)
      C::Operand::template mma<C::kBlockN, kAMN, kBMN>(acc, da[k16], db[k16], k16 > 0 ? 1u : first_scale);
  }
  wgmma_commit();
}

// mma_tile's hook is called once per tile, right after the first K block's MMAs were issued (they
// run asynchronously): a megakernel uses it to publish the previous tile's completion off the
// critical path. accumulate: the accumulators hold partial sums already (a wgrad carried over
// from an earlier call) and the MMAs add to them instead of starting from 0.

template <class C, bool kAMN, bool kBMN, bool kMaskK, bool kCluster = false, class Hook = NoHook>
__device__ __forceinline__ void mma_tile(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg,
                                         uint32_t ct, float (&acc)[C::kAccRegs], const WaitBound& wb,
                                         Skew<C>& skew, uint32_t peer = 0, const Hook& on_first_block = Hook{},
                                         bool accumulate = false) {
  static_assert(C::Operand::kMNMajor || (!kAMN && !kBMN), "this operand type is K-major only");
  const bool staggered = skew.applies(t);
  uint64_t* skew_bar = sm.skew(skew.tiles & 1u);
  const uint32_t skew_parity = (skew.tiles >> 1) & 1u;
  if (staggered) {
    ++skew.tiles;
    if (cwg == 1) mbar_wait(skew_bar, skew_parity, wb, kSiteSkew);
  }
  // Zeroing (the first wgmma also starts from 0) ends the previous tile's accumulators' lifetime
  // at its epilogue: wgmma's operands are read-write, so without it they would stay live (the
  // forms then spill). An empty asm definition instead makes ptxas serialise the wgmmas (C7515).
  if (!accumulate) {
#pragma unroll
    for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  }
  if (t.k_blocks == 0) return;
  // Both A layouts put warpgroup cwg's 64 rows at +cwg * 8 KB of the stage's A tile.
  const uint32_t a0 = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b0 = smem_addr(sm.b(0));
  uint32_t prev = 0;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    // K steps of this block: all four, or in an expert's K-masked last block only those holding
    // valid rows (a weight gradient's expert of 260 rows ran as slowly as one of 320: one H100,
    // notes/gemm.md), with the mask up to the last issued step's end.
    int steps = C::kBlockK / C::Operand::kStepK;
    if constexpr (kMaskK) {
      if (kb == t.k_blocks - 1 && t.k_last_valid < C::kBlockK) {
        const int valid = max(t.k_last_valid, 0);  // (k_grouped_tile gives 1..63 here)
        steps = max(1, (valid + C::Operand::kStepK - 1) / C::Operand::kStepK);
        mask_k_rows(sm, s, valid, steps * C::Operand::kStepK, ct);
      }
    }
    const uint32_t as = a0 + s * kATileBytes;
    const uint32_t bs = b0 + s * C::kBTileBytes;
    const bool more = accumulate || kb > 0;
    static_assert(C::kBlockK / C::Operand::kStepK == 4, "four K steps per stage");
    if constexpr (kMaskK) {
      // Each count a static run of wgmmas (a runtime test between two wgmmas of a group makes
      // ptxas serialise them: notes/gemm.md), chosen by warp votes so that ptxas sees a uniform
      // branch (on the per-thread count it serialised every wgmma of the kernel: C7520). Full
      // blocks first, so they pay one vote: with the short counts tested first the wgrad at 256
      // rows per expert was ~4% slower (same A/B file).
      if (__all_sync(0xffffffffu, steps == 4))
        mma_k_steps<C, kAMN, kBMN, 4>(acc, as, bs, more);
      else if (__all_sync(0xffffffffu, steps == 1))
        mma_k_steps<C, kAMN, kBMN, 1>(acc, as, bs, more);
      else if (__all_sync(0xffffffffu, steps == 2))
        mma_k_steps<C, kAMN, kBMN, 2>(acc, as, bs, more);
      else
        mma_k_steps<C, kAMN, kBMN, 3>(acc, as, bs, more);
    } else {
      mma_k_steps<C, kAMN, kBMN, 4>(acc, as, bs, more);
    }
    if (kb == 0) on_first_block();
    fence_operands(acc);
    wgmma_wait<1>();  // the previous block's group is done: its stage can be refilled
    fence_operands(acc);
    if (kb > 0) release_stage<C, kCluster>(sm, prev, peer);
    if (staggered && cwg == 0 && kb == skew.stages - 1 && ct == 0) mbar_arrive(skew_bar);
    prev = s;
    ps.advance();
  }
  wgmma_wait<0>();
  fence_operands(acc);
  release_stage<C, kCluster>(sm, prev, peer);
}

// A consumer warpgroup whose 64 rows of the tile are all padding: waits for each stage of the tile
// and releases it without computing, so the pipeline stays in step with the other warpgroup (which
// then has the tensor cores to itself). Its epilogue is skipped too.
template <class C, bool kCluster = false, class Hook = NoHook>
__device__ __forceinline__ void skip_tile(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, const WaitBound& wb,
                                          uint32_t peer = 0, const Hook& on_first_block = Hook{}) {
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    mbar_wait(sm.full(ps.stage), ps.phase, wb, kSiteConsumerFull);
    if (kb == 0) on_first_block();
    release_stage<C, kCluster>(sm, ps.stage, peer);
    ps.advance();
  }
}

// Split-N form of a tile whose tokens all sit in its first 64 rows: both consumer warpgroups
// compute those 64 rows, warpgroup c the output columns [c, c+1) * BLOCK_N/2 (B rows of the
// stage's K-major B tile), with m64n(BLOCK_N/2) MMAs into the first half of `acc`. The K order is
// mma_tile's, so every output element is the same fp32 sum; the tile takes about half the time
// of a full one (a lone warpgroup, as in skip_tile, does not run faster than two). Forward forms
// only: K-major A and B, no K mask.
template <class C, bool kCluster = false, class Hook = NoHook>
__device__ __forceinline__ void mma_tile_split_n(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg,
                                                 float (&acc)[C::kAccRegs], const WaitBound& wb, uint32_t peer = 0,
                                                 const Hook& on_first_block = Hook{}) {
  constexpr int kHalfN = C::kBlockN / 2;
  float(&h)[kHalfN / 2] = reinterpret_cast<float(&)[kHalfN / 2]>(acc);
#pragma unroll
  for (int i = 0; i < kHalfN / 2; ++i) h[i] = 0.0f;
  if (t.k_blocks == 0) return;
  const uint32_t a0 = smem_addr(sm.a(0));  // rows 0..63 for both warpgroups
  const uint32_t b0 = smem_addr(sm.b(0)) + uint32_t(cwg) * uint32_t(kHalfN) * 128u;  // 1024-aligned
  uint32_t prev = 0;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    const uint32_t as = a0 + s * kATileBytes;
    const uint32_t bs = b0 + s * C::kBTileBytes;
    fence_operands(h);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < C::kBlockK / C::Operand::kStepK; ++k16)
      C::Operand::template mma<kHalfN, false, false>(h, desc_k_major(as, k16), desc_k_major(bs, k16),
                                                    (kb > 0 || k16 > 0) ? 1u : 0u);
    wgmma_commit();
    if (kb == 0) on_first_block();
    fence_operands(h);
    wgmma_wait<1>();
    fence_operands(h);
    if (kb > 0) release_stage<C, kCluster>(sm, prev, peer);
    prev = s;
    ps.advance();
  }
  wgmma_wait<0>();
  fence_operands(h);
  release_stage<C, kCluster>(sm, prev, peer);
}

}  // namespace mok::gemm::engine
