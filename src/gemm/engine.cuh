// mok — the SM90 BF16 tile engine: warp-specialized, TMA-fed, wgmma-based, persistent.
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

namespace mok::gemm::engine {

using namespace mok::gemm::sm90;

inline constexpr int kBlockM = 128;
inline constexpr int kBlockK = 64;
inline constexpr int kThreads = 384;
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
inline constexpr uint32_t kATileBytes = kBlockM * kBlockK * 2;  // 16 KB
inline constexpr uint32_t kChunkBytes = 64 * 64 * 2;  // 8 KB: [64 rows][64 bf16], 128B-swizzled

// Tile configuration: BLOCK_N = 256 (the default: 128 accumulators per consumer thread, 4 stages
// of 48 KB) or 128 (problems with too few 256-wide tiles to fill the GPU: 64 accumulators, 6
// stages of 32 KB).
template <int kBN>
struct Cfg {
  static_assert(kBN == 256 || kBN == 128, "BLOCK_N is 256 or 128");
  static constexpr int kBlockN = kBN;
  static constexpr int kStages = kBN == 256 ? 4 : 6;
  static constexpr int kAccRegs = kBN / 2;  // m64nN fp32 accumulators per thread
  static constexpr int kChunks = kBN / 64;  // 64-column chunks of the output / MN-major B tile
  static constexpr uint32_t kBTileBytes = uint32_t(kBN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kATileBytes + kBTileBytes;
  static constexpr uint32_t kEpiOffset = kStages * kStageBytes;
  static constexpr uint32_t kBarOffset = kEpiOffset + 4 * kChunkBytes;
  static constexpr uint32_t kNumBars = 2 * kStages + 2;  // full[], empty[], skew[2]
  static constexpr uint32_t kSmemBytes = kBarOffset + kNumBars * 8 + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 232448, "exceeds the 227 KB of shared memory a CTA may use");
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
  int32_t k_blocks;      // 64-wide K blocks (0: the tile is zero)
  int32_t k_last_valid;  // valid K rows of the last block (64 unless the tile is K-masked)
  int32_t out_row;       // output row of the tile's first row
  int32_t out_batch;     // output outer coordinate (3-D output maps)
};

// Hook of mma_tile and its variants (a megakernel's callback at a fixed point of a tile); none by default.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
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
// Returns false (nothing more issued, the stage not armed) when a wait for a free stage expired:
// the producer must then stop, so that each stage has at most one load in flight and
// drain_stages can wait for exactly those.
template <class C, bool kAMN, bool kBMN, bool kCluster = false>
__device__ __forceinline__ bool produce_tile(const Smem<C>& sm, PipeState<C>& ps, const Tile& t,
                                             const CUtensorMap* map_a, const CUtensorMap* map_b,
                                             const WaitBound& wb, const CUtensorMap* map_b_half = nullptr,
                                             bool shared = false, uint32_t rank = 0) {
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    if (!mbar_wait(sm.empty(ps.stage), ps.phase ^ 1u, wb, kSiteProducerEmpty)) return false;
    uint64_t* full = sm.full(ps.stage);
    mbar_arrive_expect_tx(full, C::kStageBytes);
    const int32_t k = t.k_begin + kb * kBlockK;
    uint8_t* a = sm.a(ps.stage);
    uint8_t* b = sm.b(ps.stage);
    if constexpr (!kAMN) {
      tma_load_2d(a, map_a, full, k, t.a_m);
    } else {
      tma_load_2d(a, map_a, full, t.a_m, k);
      tma_load_2d(a + kChunkBytes, map_a, full, t.a_m + 64, k);
    }
    if (kCluster && shared) {
      if constexpr (!kBMN) {
        tma_load_3d_multicast(b + rank * (C::kBTileBytes / 2), map_b_half, full, k,
                              t.b_n + int32_t(rank) * (C::kBlockN / 2), t.b_batch, 0x3);
      } else {
#pragma unroll
        for (int h = 0; h < C::kChunks / 2; ++h) {
          const int c = int(rank) * (C::kChunks / 2) + h;
          tma_load_3d_multicast(b + c * kChunkBytes, map_b, full, t.b_n + 64 * c, k, t.b_batch, 0x3);
        }
      }
    } else if constexpr (!kBMN) {
      tma_load_3d(b, map_b, full, k, t.b_n, t.b_batch);
    } else {
#pragma unroll
      for (int c = 0; c < C::kChunks; ++c)
        tma_load_3d(b + c * kChunkBytes, map_b, full, t.b_n + 64 * c, k, t.b_batch);
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

// Zeroes K rows [valid, 64) of both operands of stage s (MN-major A and B only): rows past an
// expert's last token are padding whose contents are unspecified (possibly NaN). Called by all
// 256 consumer threads (ct = 0..255).
template <class C>
__device__ __forceinline__ void mask_k_rows(const Smem<C>& sm, uint32_t s, int valid, uint32_t ct) {
  const uint32_t rows = uint32_t(kBlockK - valid);
  const uint32_t per_chunk = rows * 8u;  // 16-byte units
  const uint32_t units = per_chunk * uint32_t(2 + C::kChunks);  // 2 A chunks + the B chunks
  for (uint32_t u = ct; u < units; u += 256u) {
    const uint32_t chunk = u / per_chunk;
    const uint32_t rem = u - chunk * per_chunk;
    const uint32_t row = uint32_t(valid) + rem / 8u;
    uint8_t* base = chunk < 2u ? sm.a(s) + chunk * kChunkBytes : sm.b(s) + (chunk - 2u) * kChunkBytes;
    *reinterpret_cast<uint4*>(base + row * 128u + (rem % 8u) * 16u) = make_uint4(0u, 0u, 0u, 0u);
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

// mma_tile's hook is called once per tile, right after the first K block's MMAs were issued (they
// run asynchronously): a megakernel uses it to publish the previous tile's completion off the
// critical path.

template <class C, bool kAMN, bool kBMN, bool kMaskK, bool kCluster = false, class Hook = NoHook>
__device__ __forceinline__ void mma_tile(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg,
                                         uint32_t ct, float (&acc)[C::kAccRegs], const WaitBound& wb,
                                         Skew<C>& skew, uint32_t peer = 0, const Hook& on_first_block = Hook{}) {
  const bool staggered = skew.applies(t);
  uint64_t* skew_bar = sm.skew(skew.tiles & 1u);
  const uint32_t skew_parity = (skew.tiles >> 1) & 1u;
  if (staggered) {
    ++skew.tiles;
    if (cwg == 1) mbar_wait(skew_bar, skew_parity, wb, kSiteSkew);
  }
  // Zeroing (the first wgmma also starts from 0) ends the previous tile's accumulators' lifetime
  // at its epilogue: wgmma's operands are read-write, so without it they would stay live.
#pragma unroll
  for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  if (t.k_blocks == 0) return;
  // Both A layouts put warpgroup cwg's 64 rows at +cwg * 8 KB of the stage's A tile.
  const uint32_t a0 = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b0 = smem_addr(sm.b(0));
  uint32_t prev = 0;
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    if constexpr (kMaskK) {
      if (kb == t.k_blocks - 1 && t.k_last_valid < kBlockK) mask_k_rows(sm, s, t.k_last_valid, ct);
    }
    const uint32_t as = a0 + s * kATileBytes;
    const uint32_t bs = b0 + s * C::kBTileBytes;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16) {
      const uint64_t da = kAMN ? desc_mn_major(as, k16, kChunkBytes) : desc_k_major(as, k16);
      const uint64_t db = kBMN ? desc_mn_major(bs, k16, kChunkBytes) : desc_k_major(bs, k16);
      wgmma_bf16<C::kBlockN, kAMN ? 1 : 0, kBMN ? 1 : 0>(acc, da, db, (kb > 0 || k16 > 0) ? 1u : 0u);
    }
    wgmma_commit();
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
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      wgmma_bf16<kHalfN, 0, 0>(h, desc_k_major(as, k16), desc_k_major(bs, k16), (kb > 0 || k16 > 0) ? 1u : 0u);
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

// ------------------------------------------------------------------------------------------------
// Epilogue building blocks (one consumer warpgroup; wt = thread index inside it, 0..127)
// ------------------------------------------------------------------------------------------------
// Chunks of [64 rows][64 columns] bf16 go through two shared-memory buffers per warpgroup:
//   buf = epi_begin(...)   waits until the buffer's previous TMA store has read it;
//   write_chunk...(buf)    stmatrix from registers (128B swizzle, as the output map expects);
//   epi_end_*(...)         proxy fence + barrier, then one thread issues the TMA store.
// A custom epilogue (e.g. the combine scatter) replaces write/end with its own stores.
struct EpiState {
  uint32_t chunks = 0;
};

template <class C>
__device__ __forceinline__ uint8_t* epi_begin(const Smem<C>& sm, int cwg, const EpiState& es, bool leader) {
  if (leader) tma_store_wait_read<1>();
  named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
  return sm.epi(cwg, es.chunks & 1u);
}
__device__ __forceinline__ void epi_end_2d(const uint8_t* buf, int cwg, EpiState& es, bool leader,
                                           const CUtensorMap* map, int32_t col, int32_t row) {
  fence_async_shared();
  named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
  if (leader) {
    tma_store_2d(map, buf, col, row);
    tma_store_commit();
  }
  ++es.chunks;
}
__device__ __forceinline__ void epi_end_3d(const uint8_t* buf, int cwg, EpiState& es, bool leader,
                                           const CUtensorMap* map, int32_t col, int32_t row,
                                           int32_t batch) {
  fence_async_shared();
  named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
  if (leader) {
    tma_store_3d(map, buf, col, row, batch);
    tma_store_commit();
  }
  ++es.chunks;
}
// Call once at the end of the kernel (leader): all stores complete before the CTA exits.
__device__ __forceinline__ void epi_finish(bool leader) {
  if (leader) tma_store_wait_all<0>();
}

// Accumulator layout of m64nNk16 (per warpgroup thread wt, warp w = wt/32, lane l): n8 block j
// holds acc[4j+0..1] at (row 16w + l/4, cols 8j + 2(l%4) + 0..1) and acc[4j+2..3] at row + 8.
// acc_row / acc_col: the first row and the first column (within block 0) of thread wt.
__device__ __forceinline__ int32_t acc_row(uint32_t wt) { return int32_t((wt >> 5) * 16u + (wt & 31u) / 4u); }
__device__ __forceinline__ int32_t acc_col(uint32_t wt) { return int32_t(2u * (wt & 3u)); }
// stmatrix x4 stores two such blocks (16 rows x 16 columns) of a warp; lane l addresses row l%8 of
// matrix l/8 (matrices: block b rows 0-7, block b rows 8-15, block b+1 rows 0-7, rows 8-15).
// kGateUpRows: the chunk's 64 rows are packed gate/up rows (16j + c gate, 16j + 8 + c up, as
// pack_gate_up): warp w's gate rows go to buffer rows 8w.., its up rows to 32 + 8w.., so the
// buffer holds 32 gate rows then 32 up rows in plain order (the swizzle depends on row % 8, which
// the move keeps).
template <bool kGateUpRows = false>
__device__ __forceinline__ uint32_t stmatrix_addr(uint32_t buf_addr, uint32_t wt, int unit_pair) {
  const uint32_t warp = wt >> 5, lane = wt & 31u;
  const uint32_t mi = lane >> 3, ri = lane & 7u;
  const uint32_t row = kGateUpRows ? (mi & 1u) * 32u + warp * 8u + ri : warp * 16u + (mi & 1u) * 8u + ri;
  const uint32_t unit = uint32_t(unit_pair) * 2u + (mi >> 1);
  return buf_addr + row * 128u + ((unit ^ ri) << 4);  // row % 8 == ri
}

// Writes accumulator blocks kB0 .. kB0+7 (64 columns) as bf16 (rows as stmatrix_addr<kGateUpRows>).
template <int kB0, int kN, bool kGateUpRows = false>
__device__ __forceinline__ void write_chunk_bf16(uint8_t* buf, const float (&acc)[kN], uint32_t wt) {
  static_assert(4 * (kB0 + 8) <= kN, "chunk outside the accumulators");
  const uint32_t base = smem_addr(buf);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    constexpr int kStride = 4;
    const int b = kB0 + 2 * q;
    stmatrix_x4(stmatrix_addr<kGateUpRows>(base, wt, q), pack_bf16x2(acc[kStride * b + 0], acc[kStride * b + 1]),
                pack_bf16x2(acc[kStride * b + 2], acc[kStride * b + 3]),
                pack_bf16x2(acc[kStride * b + 4], acc[kStride * b + 5]),
                pack_bf16x2(acc[kStride * b + 6], acc[kStride * b + 7]));
  }
}

// SwiGLU of one gate/up pair at the reference's rounding points: g and u rounded to bf16, then
// silu(g) * u in fp32 (silu(g) = g / (1 + exp(-g))); the caller rounds the result to bf16.
// exp and the division use the SFU approximations (__expf: ex2.approx, __fdividef: rcp.approx),
// a few 1e-7 relative, far below the bf16 rounding that follows; the exact forms cost several
// percent of an FC1 tile's time in this epilogue. For g < -87 exp overflows: silu -> -0.
__device__ __forceinline__ float swiglu(float acc_g, float acc_u) {
  const float g = bf16_round(acc_g);
  const float u = bf16_round(acc_u);
  const float silu = __fdividef(g, 1.0f + __expf(-g));
  return silu * u;
}

// FC1 with gate/up rows interleaved in groups of 8: accumulator block 2j is gate, 2j+1 is up, for
// the same 8 intermediate columns. Writes h blocks kH0 .. kH0+7 (64 h columns).
template <int kH0, int kN>
__device__ __forceinline__ void write_chunk_swiglu(uint8_t* buf, const float (&acc)[kN], uint32_t wt) {
  static_assert(8 * (kH0 + 8) <= kN, "chunk outside the accumulators");
  const uint32_t base = smem_addr(buf);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t r[4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int hb = kH0 + 2 * q + m;
      const int g = 4 * (2 * hb), u = 4 * (2 * hb + 1);
      r[2 * m + 0] = pack_bf16x2(swiglu(acc[g + 0], acc[u + 0]), swiglu(acc[g + 1], acc[u + 1]));
      r[2 * m + 1] = pack_bf16x2(swiglu(acc[g + 2], acc[u + 2]), swiglu(acc[g + 3], acc[u + 3]));
    }
    stmatrix_x4(stmatrix_addr(base, wt, q), r[0], r[1], r[2], r[3]);
  }
}


// ------------------------------------------------------------------------------------------------
// Whole-tile epilogues (one consumer warpgroup: rows 64*cwg .. 64*cwg+63 of the tile)
// ------------------------------------------------------------------------------------------------
// One 64-column chunk of a warpgroup's 64 rows, when `active`: staged in the shared chunk buffer,
// then TMA-stored to `map` at (col, row) or, with batch >= 0, (col, row, batch). Plain: bf16 of
// accumulator blocks 8*kCH..8*kCH+7; kSwiGLU: h chunk kCH (from gate/up blocks 16*kCH..). Chunks
// beyond the tile's accumulators compile to nothing.
template <class C, int kCH, bool kSwiGLU = false, int kAcc = C::kAccRegs>
__device__ __forceinline__ void store_chunk(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                            const float (&acc)[kAcc], bool active, const CUtensorMap* map,
                                            int32_t col, int32_t row, int32_t batch = -1) {
  // kAcc / 32 = 64-column chunks held; a SwiGLU chunk needs the gate/up chunks 2kCH and 2kCH+1.
  if constexpr ((kSwiGLU ? 2 * kCH + 1 : kCH) < kAcc / 32) {
    if (!active) return;
    const bool leader = wt == 0;
    uint8_t* buf = epi_begin(sm, cwg, es, leader);
    if constexpr (kSwiGLU)
      write_chunk_swiglu<8 * kCH>(buf, acc, wt);
    else
      write_chunk_bf16<8 * kCH>(buf, acc, wt);
    if (batch < 0)
      epi_end_2d(buf, cwg, es, leader, map, col, row);
    else
      epi_end_3d(buf, cwg, es, leader, map, col, row, batch);
  }
}

// The FC1 chunks of one warpgroup's accumulators (kAcc of them: its rows `gu_row`/`h_row`,
// packed columns from b_n).
template <class C, int kAcc>
__device__ __forceinline__ void fc1_chunks(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                           const float (&acc)[kAcc], const CUtensorMap* gu, int32_t gu_row,
                                           const CUtensorMap* h, int32_t h_row, int32_t b_n, int32_t n) {
  const int32_t h0 = b_n / 2;
  const bool g = gu != nullptr;
  store_chunk<C, 0, false, kAcc>(sm, es, cwg, wt, acc, g && b_n < n, gu, b_n, gu_row);
  store_chunk<C, 1, false, kAcc>(sm, es, cwg, wt, acc, g && b_n + 64 < n, gu, b_n + 64, gu_row);
  store_chunk<C, 0, true, kAcc>(sm, es, cwg, wt, acc, h0 < n / 2, h, h0, h_row);
  store_chunk<C, 2, false, kAcc>(sm, es, cwg, wt, acc, g && b_n + 128 < n, gu, b_n + 128, gu_row);
  store_chunk<C, 3, false, kAcc>(sm, es, cwg, wt, acc, g && b_n + 192 < n, gu, b_n + 192, gu_row);
  store_chunk<C, 1, true, kAcc>(sm, es, cwg, wt, acc, h0 + 64 < n / 2, h, h0 + 64, h_row);
}

// The plain bf16 chunks of one warpgroup's accumulators.
template <class C, int kAcc>
__device__ __forceinline__ void store_chunks(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                             const float (&acc)[kAcc], const CUtensorMap* d, int32_t row,
                                             int32_t b_n, int32_t n, int32_t batch) {
  store_chunk<C, 0, false, kAcc>(sm, es, cwg, wt, acc, b_n < n, d, b_n, row, batch);
  store_chunk<C, 1, false, kAcc>(sm, es, cwg, wt, acc, b_n + 64 < n, d, b_n + 64, row, batch);
  store_chunk<C, 2, false, kAcc>(sm, es, cwg, wt, acc, b_n + 128 < n, d, b_n + 128, row, batch);
  store_chunk<C, 3, false, kAcc>(sm, es, cwg, wt, acc, b_n + 192 < n, d, b_n + 192, row, batch);
}

// FC1: the gate/up pre-activations (bf16, packed order) to `gu` at gu_row (skipped when gu is
// null) and h = silu(g) * u to `h` at h_row. The two outputs may live at different rows (the
// megakernel keeps gu for every routed row but h only in the ring). b_n: first packed column of
// the tile; n: packed width 2I. Order gu0, gu1, h0, gu2, gu3, h1: h chunk j reads accumulator
// blocks 16j..16j+15 (= gu chunks 2j, 2j+1), so the first half of the accumulators dies halfway.
template <class C>
__device__ __forceinline__ void epilogue_fc1(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                             const float (&acc)[C::kAccRegs], const CUtensorMap* gu,
                                             int32_t gu_row, const CUtensorMap* h, int32_t h_row,
                                             int32_t b_n, int32_t n) {
  fc1_chunks<C, C::kAccRegs>(sm, es, cwg, wt, acc, gu, gu_row + 64 * cwg, h, h_row + 64 * cwg, b_n, n);
}

// Plain bf16 store of the tile to `d` [rows, n] at `row` (FC2, dgrad), or with batch >= 0 to the
// 3-D map [batch, rows, n] (wgrad).
template <class C>
__device__ __forceinline__ void epilogue_store(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                               const float (&acc)[C::kAccRegs], const CUtensorMap* d,
                                               int32_t row, int32_t b_n, int32_t n, int32_t batch = -1) {
  store_chunks<C, C::kAccRegs>(sm, es, cwg, wt, acc, d, row + 64 * cwg, b_n, n, batch);
}

// Wgrad of a packed gate/up weight (dW1p's rows, 64 per warpgroup: 32 gate and 32 up rows) stored
// straight into the two plain-order gradients: each 64-column chunk's gate rows to `gate` and its
// up rows to `up` ([batch, rows / 2, n] 3-D maps with boxes of 32 rows) at row packed_row / 2.
// Same accumulators as epilogue_store, so the same bits as dW1p's rows. packed_row is a multiple
// of 64; rows past the maps' end are clipped by the TMA stores.
template <class C>
__device__ __forceinline__ void epilogue_store_gate_up(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                       const float (&acc)[C::kAccRegs], const CUtensorMap* gate,
                                                       const CUtensorMap* up, int32_t row, int32_t b_n, int32_t n,
                                                       int32_t batch) {
  const int32_t half_row = (row + 64 * cwg) / 2;
  const bool leader = wt == 0;
  const auto chunk = [&](auto kch) {
    constexpr int kCH = decltype(kch)::value;
    if constexpr (kCH < C::kChunks) {
      if (b_n + 64 * kCH >= n) return;
      uint8_t* buf = epi_begin(sm, cwg, es, leader);
      write_chunk_bf16<8 * kCH, C::kAccRegs, true>(buf, acc, wt);
      fence_async_shared();
      named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
      if (leader) {
        tma_store_3d(gate, buf, b_n + 64 * kCH, half_row, batch);
        tma_store_3d(up, buf + 32 * 128, b_n + 64 * kCH, half_row, batch);
        tma_store_commit();  // one bulk group per chunk, as epi_begin's wait expects
      }
      ++es.chunks;
    }
  };
  chunk(std::integral_constant<int, 0>{});
  chunk(std::integral_constant<int, 1>{});
  chunk(std::integral_constant<int, 2>{});
  chunk(std::integral_constant<int, 3>{});
}

// Epilogues of a split-N tile (mma_tile_split_n): rows 0..63 of the tile, warpgroup cwg's half
// of the columns, from the first half of the accumulators.
template <class C>
__device__ __forceinline__ void epilogue_fc1_split_n(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                     const float (&acc)[C::kAccRegs], const CUtensorMap* gu,
                                                     int32_t gu_row, const CUtensorMap* h, int32_t h_row,
                                                     int32_t b_n, int32_t n) {
  constexpr int kHalf = C::kAccRegs / 2;
  const float(&a)[kHalf] = reinterpret_cast<const float(&)[kHalf]>(acc);
  fc1_chunks<C, kHalf>(sm, es, cwg, wt, a, gu, gu_row, h, h_row, b_n + cwg * (C::kBlockN / 2), n);
}
// h of a split-N FC1 tile at BLOCK_N 128: warpgroup cwg holds 64 packed columns (4 gate/up
// pairs of 8), i.e. 32 h columns, half of a 64-column chunk of the h map's 128B-swizzled boxes.
// Rather than pair the warpgroups over one shared chunk, each thread stores its h values to
// global memory directly (4-byte stores of 2 adjacent columns; split-N tiles are the rare tails
// of experts with <= 64 rows, so the store pattern does not matter). Rows 0..63 of the tile only;
// columns >= inter are skipped. Same values and rounding as write_chunk_swiglu. h must be dense
// [rows, inter] (as plan_fc1's h; a strided or ring h, as in the megakernel, would need a pitch).
template <class C>
__device__ __forceinline__ void store_h_split_n_direct(const float (&acc)[C::kAccRegs], uint32_t wt, int cwg,
                                                       void* h, int32_t h_row, int32_t b_n, int32_t inter) {
  static_assert(C::kBlockN == 128, "BLOCK_N 256 stores whole h chunks through TMA");
  constexpr int kHalf = C::kAccRegs / 2;  // 32: m64n64 accumulators of this warpgroup's half
  const float(&a)[kHalf] = reinterpret_cast<const float(&)[kHalf]>(acc);
  const int32_t row = h_row + acc_row(wt);
  const int32_t col0 = (b_n + cwg * (C::kBlockN / 2)) / 2 + acc_col(wt);
  auto* out = static_cast<uint16_t*>(h);
#pragma unroll
  for (int hb = 0; hb < kHalf / 8; ++hb) {  // 8-column h blocks: gate block 2hb, up block 2hb + 1
    const int g = 4 * (2 * hb), u = 4 * (2 * hb + 1);
    const int32_t col = col0 + 8 * hb;
    if (col >= inter) continue;  // inter is a multiple of 8: col + 1 < inter as well
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows row and row + 8
      const uint32_t v = pack_bf16x2(swiglu(a[g + 2 * r], a[u + 2 * r]), swiglu(a[g + 2 * r + 1], a[u + 2 * r + 1]));
      *reinterpret_cast<uint32_t*>(out + int64_t(row + 8 * r) * inter + col) = v;  // col even: aligned
    }
  }
}

// SwiGLU backward of one element at the reference's rounding points (ffn_backward in
// src/reference/engine.cpp): d_h = rnd(acc), s = sigmoid(g), d_u = g * s * d_h and
// d_g = s * (1 + g * (1 - s)) * u * d_h in fp32, left to right (the caller rounds both to bf16),
// g and u the forward's bf16 pre-activations. 1 + g * (1 - s) is rounded after the multiply and
// after the add, as the reference (built without contraction) does: nvcc would otherwise fuse
// it into one FMA. exp and the division on the SFU, as in swiglu(); for g < -87 exp overflows
// and s -> 0 (the reference keeps s ~ 1e-38 there: both give d_g, d_u of 0 after rounding).
__device__ __forceinline__ void swiglu_backward(float acc_dh, float g, float u, float& dg, float& du) {
  const float dh = bf16_round(acc_dh);
  const float s = __fdividef(1.0f, 1.0f + __expf(-g));
  du = g * s * dh;
  dg = s * __fadd_rn(1.0f, __fmul_rn(g, 1.0f - s)) * u * dh;
}

// FC2's dgrad fused with the SwiGLU backward (Form DgradSwiGLU). The accumulators hold d_h for
// this warpgroup's 64 rows and the tile's intermediate columns [b_n, b_n + BLOCK_N); the output
// is d_gu in the packed gate/up order of gu (pack_gate_up: packed column 16j + c is the gate of
// intermediate column 8j + c, 16j + 8 + c its up), i.e. the packed columns [2 b_n, 2 b_n + 2 BLOCK_N):
// twice as many chunks as a plain store. Packed chunk q holds intermediate blocks 4q..4q+3, each
// as a d_g block and a d_u block, exactly the pair one stmatrix x4 writes. Each thread reads the
// g/u pairs of its own accumulator elements straight from global memory (two 4-byte loads per
// 8-column block and row: a quad of lanes reads 16 bytes of gate and the 16 bytes of up next to
// them, one 32-byte sector), one chunk ahead of the chunk it converts (the first chunk's loads
// wait after the tile's last MMAs: not overlapped). Intermediate columns >= inter are neither
// read nor stored (the TMA store clips the packed width 2 * inter). Every tile reads exactly the
// gu elements it writes, before writing them (in whole 32-byte sectors per chunk), so d_gu may
// alias gu. gu is read with generic-proxy loads: correct when an earlier kernel wrote it; a
// megakernel whose FC1 TMA-stores gu in the same launch must order those stores before these
// loads (store wait, proxy fence, release / acquire) as it does for h.
template <class C>
__device__ __forceinline__ void epilogue_dgrad_swiglu(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                      const float (&acc)[C::kAccRegs], const void* gu,
                                                      const CUtensorMap* d_gu, int32_t row, int32_t b_n,
                                                      int32_t inter) {
  constexpr int kPackedChunks = 2 * C::kChunks;  // 64-column chunks of the packed output
  const int64_t pitch = 2 * int64_t(inter);
  const int32_t out_row = row + 64 * cwg;
  // This thread's rows (r and r + 8 of its accumulator layout), at its first g column.
  const uint16_t* g0 = static_cast<const uint16_t*>(gu) + int64_t(out_row + acc_row(wt)) * pitch + 2 * int64_t(b_n) +
                       acc_col(wt);
  const uint16_t* g1 = g0 + 8 * pitch;
  // v[q & 1][4m + 2rr + {0: g, 1: u}]: the bf16 pairs of block m of chunk q, row rr (kept packed:
  // 32 registers for two chunks next to the 128 accumulators).
  uint32_t v[2][16];
  const auto load = [&](int q) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = 4 * q + m;  // intermediate block of the tile
      uint32_t* d = &v[q & 1][4 * m];
      const bool valid = b_n + 8 * j < inter;
      d[0] = valid ? *reinterpret_cast<const uint32_t*>(g0 + 16 * j) : 0u;
      d[1] = valid ? *reinterpret_cast<const uint32_t*>(g0 + 16 * j + 8) : 0u;
      d[2] = valid ? *reinterpret_cast<const uint32_t*>(g1 + 16 * j) : 0u;
      d[3] = valid ? *reinterpret_cast<const uint32_t*>(g1 + 16 * j + 8) : 0u;
    }
  };
  load(0);
  const bool leader = wt == 0;
#pragma unroll
  for (int q = 0; q < kPackedChunks; ++q) {
    if (q + 1 < kPackedChunks) load(q + 1);
    if (2 * b_n + 64 * q >= 2 * inter) continue;  // uniform over the warpgroup
    uint8_t* buf = epi_begin(sm, cwg, es, leader);
    const uint32_t base = smem_addr(buf);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = 4 * q + m;
      const uint32_t* d = &v[q & 1][4 * m];
      uint32_t dg[2], du[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const uint32_t g = d[2 * rr], u = d[2 * rr + 1];
        float g_lo, u_lo, g_hi, u_hi;
        swiglu_backward(acc[4 * j + 2 * rr], bf16x2_lo(g), bf16x2_lo(u), g_lo, u_lo);
        swiglu_backward(acc[4 * j + 2 * rr + 1], bf16x2_hi(g), bf16x2_hi(u), g_hi, u_hi);
        dg[rr] = pack_bf16x2(g_lo, g_hi);
        du[rr] = pack_bf16x2(u_lo, u_hi);
      }
      // Chunk blocks 2m (d_g) and 2m + 1 (d_u): matrices rows 0-7 / 8-15 of each.
      stmatrix_x4(stmatrix_addr(base, wt, m), dg[0], dg[1], du[0], du[1]);
    }
    epi_end_2d(buf, cwg, es, leader, d_gu, 2 * b_n + 64 * q, out_row);
  }
}

template <class C>
__device__ __forceinline__ void epilogue_store_split_n(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                       const float (&acc)[C::kAccRegs], const CUtensorMap* d,
                                                       int32_t row, int32_t b_n, int32_t n) {
  constexpr int kHalf = C::kAccRegs / 2;
  const float(&a)[kHalf] = reinterpret_cast<const float(&)[kHalf]>(acc);
  store_chunks<C, kHalf>(sm, es, cwg, wt, a, d, row, b_n + cwg * (C::kBlockN / 2), n, -1);
}

}  // namespace mok::gemm::engine
