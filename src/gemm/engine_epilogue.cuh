// mok — the SM90 BF16 tile engine, part 2: the epilogues (accumulators -> bf16 chunks -> TMA
// stores; the fused SwiGLU and its backward). The mainloop is in engine_mainloop.cuh.
#pragma once

#include <cstdint>

#include "gemm/engine_mainloop.cuh"
#include "gemm/swiglu_math.cuh"

namespace mok::gemm::engine {

// ------------------------------------------------------------------------------------------------
// Epilogue building blocks (one consumer warpgroup; wt = thread index inside it, 0..127)
// ------------------------------------------------------------------------------------------------
// Chunks of [64 rows][64 columns] bf16 (or [64][32] fp32: epilogue_accumulate_tma) go through two
// shared-memory buffers of kChunkBytes per warpgroup:
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
__device__ __forceinline__ uint32_t stmatrix_addr(uint32_t buf_addr, uint32_t wt, int unit_pair) {
  const uint32_t warp = wt >> 5, lane = wt & 31u;
  const uint32_t mi = lane >> 3, ri = lane & 7u;
  const uint32_t row = warp * 16u + (mi & 1u) * 8u + ri;
  const uint32_t unit = uint32_t(unit_pair) * 2u + (mi >> 1);
  return buf_addr + row * 128u + ((unit ^ ri) << 4);  // row % 8 == ri
}

// Writes accumulator blocks kB0 .. kB0+7 (64 columns) as bf16.
template <int kB0, int kN>
__device__ __forceinline__ void write_chunk_bf16(uint8_t* buf, const float (&acc)[kN], uint32_t wt) {
  static_assert(4 * (kB0 + 8) <= kN, "chunk outside the accumulators");
  const uint32_t base = smem_addr(buf);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    constexpr int kStride = 4;
    const int b = kB0 + 2 * q;
    stmatrix_x4(stmatrix_addr(base, wt, q), pack_bf16x2(acc[kStride * b + 0], acc[kStride * b + 1]),
                pack_bf16x2(acc[kStride * b + 2], acc[kStride * b + 3]),
                pack_bf16x2(acc[kStride * b + 4], acc[kStride * b + 5]),
                pack_bf16x2(acc[kStride * b + 6], acc[kStride * b + 7]));
  }
}

// SwiGLU of one gate/up pair at the reference's rounding points: g and u rounded to bf16, then
// silu(g) * u in fp32 (swiglu_math.cuh); the caller rounds the result to bf16. exp and the
// division use the SFU approximations, a few 1e-7 relative, far below the bf16 rounding that
// follows; the exact forms cost several percent of an FC1 tile's time in this epilogue.
__device__ __forceinline__ float swiglu(float acc_g, float acc_u) {
  return swiglu_of_bf16(bf16_round(acc_g), bf16_round(acc_u));
}

// The accumulator block of h block hb (8 intermediate columns of the tile) in FC1's packed order
// (mok/gemm.hpp): each 64-column chunk c holds gate blocks 8c..8c+3 then the up blocks 8c+4..8c+7 of
// h blocks 4c..4c+3; the up block of a gate block is 4 further on.
__host__ __device__ constexpr int gate_block_of(int hb) { return 8 * (hb / 4) + hb % 4; }
constexpr int kUpBlockOffset = 4;

// FC1 in packed order: writes h blocks kH0 .. kH0+7 (64 h columns), from accumulator chunks
// kH0/4 and kH0/4 + 1.
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
      const int g = 4 * gate_block_of(hb), u = g + 4 * kUpBlockOffset;
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

// FC1's dgrad with the reverse dispatch fused (FormDgradScatter, plan_dgrad_scatter): each
// 64-column chunk is staged in a chunk buffer as epilogue_store stages it, then read back 16 bytes
// a thread (8 threads cover a row's 128 bytes: whole lines) and stored at the row's token slot,
// this rank's or a peer's (st.global: a tensor map addresses one array, and the slots are the
// ranks' windows, row by row). So the dense d_x rows are neither written here nor read back by a
// push kernel. Padding rows (src_rank < 0) are not stored, nor anything once the abort word or the
// kernel's error word is set (read once a tile). Two chunk buffers alternate and epi_begin's barrier precedes each chunk's
// stmatrix: a buffer is written again only after every thread has read it back.
template <class C>
__device__ __forceinline__ void epilogue_scatter_rows(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                      const float (&acc)[C::kAccRegs], const int32_t* src_rank,
                                                      const int32_t* src_slot, void* const* to_ranks,
                                                      const uint32_t* abort, const unsigned int* error,
                                                      int64_t row_base, int32_t row, int32_t b_n, int32_t n) {
  const bool leader = wt == 0;
  const uint32_t unit = wt & 7u, r0 = wt >> 3;  // this thread's rows: r0 + 16 i of the warpgroup's 64
  // Neither after an abort nor after one of this kernel's bounded waits expired (its accumulators
  // are then garbage, which the dense form would leave in its own rows, but this one would put
  // into the owners' windows).
  uint32_t stop = 0, failed = 0;
  if (abort != nullptr) asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(stop) : "l"(abort));
  if (error != nullptr) asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(failed) : "l"(error));
  stop |= failed;
  uint16_t* to[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t g = row_base + row + 64 * cwg + int32_t(r0) + 16 * i;
    const int32_t rank = __ldg(src_rank + g);
    to[i] = nullptr;
    if (rank >= 0 && stop == 0u) {
      const auto at = __ldg(reinterpret_cast<const unsigned long long*>(to_ranks) + rank);
      to[i] = reinterpret_cast<uint16_t*>(at) + int64_t(__ldg(src_slot + g)) * n;
    }
  }
  const auto chunk = [&](auto kch) {
    constexpr int kCH = decltype(kch)::value;
    if constexpr (kCH < C::kAccRegs / 32) {
      const int32_t col = b_n + 64 * kCH + 8 * int32_t(unit);
      if (b_n + 64 * kCH >= n) return;
      uint8_t* buf = epi_begin(sm, cwg, es, leader);
      write_chunk_bf16<8 * kCH, C::kAccRegs>(buf, acc, wt);
      named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
      const uint32_t base = smem_addr(buf);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t r = r0 + 16u * uint32_t(i);
        uint32_t v0, v1, v2, v3;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(base + r * 128u + ((unit ^ (r & 7u)) << 4)));
        if (to[i] != nullptr && col < n)
          asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(to[i] + col), "r"(v0), "r"(v1), "r"(v2),
                       "r"(v3)
                       : "memory");
      }
      ++es.chunks;
    }
  };
  chunk(std::integral_constant<int, 0>{});
  chunk(std::integral_constant<int, 1>{});
  chunk(std::integral_constant<int, 2>{});
  chunk(std::integral_constant<int, 3>{});
}

// The weight gradient's tile added into fp32 gradients through the TMA (WgradArgs::accumulate):
// each [64 rows][32 columns] fp32 chunk of the warpgroup's accumulators is staged in a chunk buffer
// (128-byte swizzle, as the F32Tile maps `d` / `up` expect) and reduce-added by one
// cp.reduce.async.bulk.tensor: whole lines, the adds done by L2, nothing loaded into the SM. Each
// element gets one add (the tile owns it), so the result is v + sum with one fp32 rounding.
// With `up`: each chunk's 32 gate rows to `d` and its 32 up rows to `up` at half the row, as
// epilogue_store_gate_up. Rows and columns past the maps' ends are clipped by the TMA.
template <class C>
__device__ __forceinline__ void epilogue_accumulate_tma(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                        const float (&acc)[C::kAccRegs], const CUtensorMap* d,
                                                        const CUtensorMap* up, int32_t row, int32_t b_n, int32_t n,
                                                        int32_t batch) {
  constexpr int kF32Chunks = C::kAccRegs / 16;  // 32-column fp32 chunks (4 n8 blocks each)
  static_assert(64 * 32 * 4 == kChunkBytes, "an fp32 chunk fills one chunk buffer");
  const bool leader = wt == 0;
  const int32_t out_row = row + 64 * cwg;
  const uint32_t q = wt & 3u;
#pragma unroll
  for (int ch = 0; ch < kF32Chunks; ++ch) {
    if (b_n + 32 * ch >= n) break;  // this and the later chunks are past the output's columns
    uint8_t* buf = epi_begin(sm, cwg, es, leader);
    const uint32_t base = smem_addr(buf);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t r = uint32_t(acc_row(wt) + 8 * h);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {  // n8 block 4 ch + jj: bytes 32 jj + 8 q of the row's 128
        const int j = 4 * ch + jj;
        const uint32_t unit = (2u * uint32_t(jj) + (q >> 1)) ^ (r & 7u);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + r * 128u + unit * 16u + (q & 1u) * 8u),
                     "f"(acc[4 * j + 2 * h]), "f"(acc[4 * j + 2 * h + 1])
                     : "memory");
      }
    }
    fence_async_shared();
    named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
    if (leader) {
      if (up == nullptr) {
        tma_reduce_add_3d(d, buf, b_n + 32 * ch, out_row, batch);
      } else {
        tma_reduce_add_3d(d, buf, b_n + 32 * ch, out_row / 2, batch);
        tma_reduce_add_3d(up, buf + 32 * 128, b_n + 32 * ch, out_row / 2, batch);
      }
      tma_store_commit();  // one bulk group per chunk, as epi_begin's wait expects
    }
    ++es.chunks;
  }
}

// Wgrad of packed gate/up rows (64 per warpgroup: in packed order, 32 gate rows then the 32 up
// rows of the same intermediate indices) stored straight into the two plain-order gradients: each
// 64-column chunk's first 32 rows to `gate` and the next 32 to `up` ([batch, rows / 2, n] 3-D maps
// with boxes of 32 rows) at row packed_row / 2. Same accumulators as epilogue_store, so the same
// bits as the packed rows. packed_row is a multiple of 64; rows past the maps' end are clipped by
// the TMA stores.
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
      write_chunk_bf16<8 * kCH, C::kAccRegs>(buf, acc, wt);
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

// The weight gradient's bf16 chunks (to the 3-D map `d` [batch, rows, n] at row `row` + 64 * cwg;
// with `up`, each chunk's 32 gate rows to `d` and its 32 up rows to `up` at half that row, as
// epilogue_store_gate_up) in batches of both chunk buffers: the batch's stmatrix writes go back
// to back, then one proxy fence and one barrier, then the leader's two TMA stores — two barriers
// and one fence per two chunks instead of per chunk. Each chunk stays one bulk group and
// es.chunks counts them, so epi_begin's buffer rule holds for whatever follows. Same
// accumulators and outputs as the per-chunk epilogues. Measured (bench/results/wgrad-epilogue-
// ab-h200x1.json): the FP8 wgrad 3-16% faster, the BF16 one 2-5% slower, so only FP8 uses it.
template <class C>
__device__ __forceinline__ void epilogue_wgrad_batched(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                       const float (&acc)[C::kAccRegs], const CUtensorMap* d,
                                                       const CUtensorMap* up, int32_t row, int32_t b_n, int32_t n,
                                                       int32_t batch) {
  constexpr int kB = 2;  // chunk buffers per warpgroup (Smem::epi)
  const bool leader = wt == 0;
  const int32_t out_row = row + 64 * cwg;
  const auto one_batch = [&](auto bi) {
    constexpr int kFirst = decltype(bi)::value * kB;
    if constexpr (kFirst < C::kChunks) {
      if (b_n + 64 * kFirst >= n) return;  // the batch's chunks are all past the output's columns
      // Both buffers free (the stores of earlier chunks have read them): the batch starts at buffer 0.
      if (leader) tma_store_wait_read<0>();
      named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
      es.chunks = (es.chunks + 1u) & ~1u;
      const bool second = kFirst + 1 < C::kChunks && b_n + 64 * (kFirst + 1) < n;
      write_chunk_bf16<8 * kFirst, C::kAccRegs>(sm.epi(cwg, 0), acc, wt);
      if constexpr (kFirst + 1 < C::kChunks) {
        if (second) write_chunk_bf16<8 * (kFirst + 1), C::kAccRegs>(sm.epi(cwg, 1), acc, wt);
      }
      fence_async_shared();
      named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
      const auto store = [&](uint32_t j) {
        const uint8_t* buf = sm.epi(cwg, j);
        const int32_t col = b_n + 64 * (kFirst + int32_t(j));
        if (leader) {
          if (up == nullptr) {
            tma_store_3d(d, buf, col, out_row, batch);
          } else {
            tma_store_3d(d, buf, col, out_row / 2, batch);
            tma_store_3d(up, buf + 32 * 128, col, out_row / 2, batch);
          }
          tma_store_commit();  // one bulk group per chunk
        }
        ++es.chunks;
      };
      store(0u);
      if (second) store(1u);
    }
  };
  one_batch(std::integral_constant<int, 0>{});
  one_batch(std::integral_constant<int, 1>{});
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
// h of a split-N FC1 tile at BLOCK_N 128: warpgroup cwg holds 64 packed columns (one group: 32
// gate and 32 up columns), i.e. 32 h columns, half of a 64-column chunk of the h map's 128B-swizzled boxes.
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
  for (int hb = 0; hb < kHalf / 8; ++hb) {  // 8-column h blocks: gate block hb, up block hb + 4
    const int g = 4 * gate_block_of(hb), u = g + 4 * kUpBlockOffset;
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
// is d_gu in the packed order of gu (mok/gemm.hpp: packed column 64q + c is the gate of
// intermediate column 32q + c, 64q + 32 + c its up), i.e. the packed columns [2 b_n, 2 b_n + 2 BLOCK_N):
// twice as many chunks as a plain store. Packed chunk q holds intermediate blocks 4q..4q+3: their
// d_g blocks then their d_u blocks. Each thread reads the g/u pairs of its own accumulator
// elements straight from global memory (two 4-byte loads per 8-column block and row: a quad of
// lanes reads 16 bytes of gate and the 16 bytes of up 64 bytes further), kGuAhead chunks ahead of
// the chunk it converts (the first chunk's loads wait after the tile's last MMAs: not overlapped;
// each chunk's math is short next to a load's latency from HBM: the standalone bf16 form keeps two
// chunks in flight, kGuAhead).
// Intermediate columns >= inter are neither read nor stored (the TMA store clips the packed width
// 2 * inter). Every tile reads exactly the gu elements it writes, before writing them, so d_gu may
// alias gu. gu is read with generic-proxy loads: correct when an earlier kernel wrote it; a
// megakernel whose FC1 TMA-stores gu in the same launch must order those stores before these
// loads (store wait, proxy fence, release / acquire) as it does for h.
// With row_weight (routed rows: d_y holds the unweighted d_out rows), the accumulators are
// g = d_out . W_down: d_h = rnd(w * rnd(g)) with the row's router weight w; the router-weight
// gradient's terms <rnd(g), h> (h = rnd(silu(g_gate) u) computed here from the gate/up values
// with FC1's bits: the forward's SwiGLU output, since <d_out, y> = <d_out . W_down, h>) are summed
// per row and 64 intermediate columns — each thread over its columns in increasing order, then
// the quad's four sums in a fixed tree — into router_partial[row * parts + column / 64] (the same
// bits whatever BLOCK_N); and h [rows, inter] receives rnd(w * h), dW_down's operand (written
// only: each thread its own elements).
// kGuAhead: chunks of gate/up loads in flight, 16 registers each. 2 in the standalone bf16 form
// (measured faster, notes/fp8.md); 1 where the consumers have no registers to spare (two ahead
// spilled 20 bytes in FP8's 256-wide form and 188 in the backward program).
template <class C, int kGuAhead = 1>
__device__ __forceinline__ void epilogue_dgrad_swiglu(const Smem<C>& sm, EpiState& es, int cwg, uint32_t wt,
                                                      const float (&acc)[C::kAccRegs], const void* gu,
                                                      const CUtensorMap* d_gu, int32_t row, int32_t b_n,
                                                      int32_t inter, const float* row_weight = nullptr,
                                                      float* router_partial = nullptr, int32_t parts = 0,
                                                      void* h = nullptr) {
  constexpr int kPackedChunks = 2 * C::kChunks;  // 64-column chunks of the packed output
  constexpr int kUp = kGateUpBox;                // packed columns from a gate column to its up column
  const int64_t pitch = 2 * int64_t(inter);
  const int32_t out_row = row + 64 * cwg;
  // This thread's rows (r and r + 8 of its accumulator layout), at its first g column.
  const uint16_t* g0 = static_cast<const uint16_t*>(gu) + int64_t(out_row + acc_row(wt)) * pitch + 2 * int64_t(b_n) +
                       acc_col(wt);
  const uint16_t* g1 = g0 + 8 * pitch;
  // v[q % kSlots][4m + 2rr + {0: g, 1: u}]: the bf16 pairs of block m of chunk q, row rr (kept
  // packed: 16 registers per chunk in flight next to the 128 accumulators).
  constexpr int kSlots = kGuAhead + 1;
  uint32_t v[kSlots][16];
  const bool weighted = row_weight != nullptr;  // uniform over the kernel
  const int32_t my_row = out_row + acc_row(wt);
  // This thread's h pairs (rows r and r + 8, its first column): written, rnd(w * h) with h =
  // rnd(silu(g) * u) of the same g, u (FC1's epilogue's bits: swiglu_math.cuh), so no pass over
  // the rows computes h first and nothing reads it here.
  uint16_t* h0 = weighted ? static_cast<uint16_t*>(h) + int64_t(my_row) * inter + b_n + acc_col(wt) : nullptr;
  const auto load = [&](int q) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = 4 * q + m;  // intermediate block of the tile
      const int col = 64 * q + 8 * m;  // its gate column, from g0
      uint32_t* d = &v[q % kSlots][4 * m];
      const bool valid = b_n + 8 * j < inter;
      d[0] = valid ? *reinterpret_cast<const uint32_t*>(g0 + col) : 0u;
      d[1] = valid ? *reinterpret_cast<const uint32_t*>(g0 + col + kUp) : 0u;
      d[2] = valid ? *reinterpret_cast<const uint32_t*>(g1 + col) : 0u;
      d[3] = valid ? *reinterpret_cast<const uint32_t*>(g1 + col + kUp) : 0u;
    }
  };
#pragma unroll
  for (int q = 0; q < kGuAhead && q < kPackedChunks; ++q) load(q);
  const bool leader = wt == 0;
  float w_row[2] = {1.0f, 1.0f}, dot[2] = {0.0f, 0.0f};
  if (weighted) {
    w_row[0] = row_weight[my_row];
    w_row[1] = row_weight[my_row + 8];
  }
#pragma unroll
  for (int q = 0; q < kPackedChunks; ++q) {
    if (q + kGuAhead < kPackedChunks) load(q + kGuAhead);
    if (2 * b_n + 64 * q >= 2 * inter) continue;  // uniform over the warpgroup
    uint8_t* buf = epi_begin(sm, cwg, es, leader);
    const uint32_t base = smem_addr(buf);
    uint32_t dg[4][2], du[4][2];  // [block m][row rr]
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = 4 * q + m;
      const uint32_t* d = &v[q % kSlots][4 * m];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const uint32_t g = d[2 * rr], u = d[2 * rr + 1];
        float g_lo, u_lo, g_hi, u_hi;
        float a_lo = acc[4 * j + 2 * rr], a_hi = acc[4 * j + 2 * rr + 1];
        if (weighted && b_n + 8 * j < inter) {  // (whole 32-column chunks today; never past inter)
          const float h_lo = bf16_round(swiglu_of_bf16(bf16x2_lo(g), bf16x2_lo(u)));
          const float h_hi = bf16_round(swiglu_of_bf16(bf16x2_hi(g), bf16x2_hi(u)));
          a_lo = bf16_round(a_lo);
          a_hi = bf16_round(a_hi);
          dot[rr] = fmaf(a_lo, h_lo, dot[rr]);
          dot[rr] = fmaf(a_hi, h_hi, dot[rr]);
          *reinterpret_cast<uint32_t*>(h0 + int64_t(8 * rr) * inter + 8 * j) =
              pack_bf16x2(__fmul_rn(w_row[rr], h_lo), __fmul_rn(w_row[rr], h_hi));
          a_lo = __fmul_rn(w_row[rr], a_lo);
          a_hi = __fmul_rn(w_row[rr], a_hi);
        }
        swiglu_backward(a_lo, bf16x2_lo(g), bf16x2_lo(u), g_lo, u_lo);
        swiglu_backward(a_hi, bf16x2_hi(g), bf16x2_hi(u), g_hi, u_hi);
        dg[m][rr] = pack_bf16x2(g_lo, g_hi);
        du[m][rr] = pack_bf16x2(u_lo, u_hi);
      }
    }
    // The end of a 64-column group (two chunks) or of the valid columns: the quad's sums.
    if (weighted && ((q & 1) == 1 || 2 * b_n + 64 * (q + 1) >= 2 * inter)) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float t = __fadd_rn(dot[rr], __shfl_xor_sync(0xffffffffu, dot[rr], 1));
        t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, 2));
        if ((wt & 3u) == 0) router_partial[int64_t(my_row + 8 * rr) * parts + (b_n + 32 * q) / 64] = t;
        dot[rr] = 0.0f;
      }
    }
    // Chunk blocks 0-3 (d_g) and 4-7 (d_u), two blocks (rows 0-7 / 8-15 of each) per stmatrix.
    stmatrix_x4(stmatrix_addr(base, wt, 0), dg[0][0], dg[0][1], dg[1][0], dg[1][1]);
    stmatrix_x4(stmatrix_addr(base, wt, 1), dg[2][0], dg[2][1], dg[3][0], dg[3][1]);
    stmatrix_x4(stmatrix_addr(base, wt, 2), du[0][0], du[0][1], du[1][0], du[1][1]);
    stmatrix_x4(stmatrix_addr(base, wt, 3), du[2][0], du[2][1], du[3][0], du[3][1]);
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
