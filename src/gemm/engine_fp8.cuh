// mok — the engine's block-scaled FP8 mainloop (issue 22, recipe 1: DeepSeek-V3's block scaling).
//
// The FP8 operand type (OperandE4m3, engine_mainloop.cuh) holds 128 K elements per stage, which is
// exactly one scale block along K: per stage the consumer warpgroup runs the stage's four k32
// wgmmas into a block accumulator `part` starting from zero, waits for them, releases the stage
// and promotes: acc += part * (a_scale[row] * b_scale), one fp32 fma per accumulator, with the
// scales of its two rows (1 x 128 activation blocks) and of the tile's 128 weight columns (128 x
// 128 weight blocks). The tensor cores' FP8 accumulation (fewer bits than fp32) thus spans 128
// products only, and the sum over K is in fp32. The two consumer warpgroups run the same tile, so
// one's promotion overlaps the other's MMAs. Below: FC1's FP8 epilogue (h as E4M3 + 1x128 scales),
// shared by the grouped form (grouped_fp8.cu) and, next, the megakernel's FC1 tasks.
#pragma once

#include <type_traits>

#include "common/fp8_format.h"
#include "gemm/engine.cuh"
#include "gemm/fp8_cvt.cuh"
#include "gemm/swiglu_math.cuh"

namespace mok::gemm::engine {

// The fp32 scales one output tile reads: A's per row at the tile's first row (`a`, rows `a_stride`
// floats apart, consecutive along K blocks) and B's for the tile's first 128 columns (`b`,
// consecutive along K blocks; the next 128 columns' at `b + b_stride`), `b_blocks` of them inside
// the matrix (a 256-wide tile at its right edge may have one: its other half reads no scale and
// is promoted with 0; its columns are not stored).
// Gate/up B (FC1, kGateUp): the tile's 128 intermediate columns are one 128 x 128 block of W_gate
// (`b`) and one of W_up (`b_up`) along N, whatever the half; in the packed order accumulator n8
// block j is a gate column when j % 8 < 4 (32 gate then 32 up columns per 64).
struct TileScales {
  const float* a;
  int64_t a_stride;
  const float* b;
  int64_t b_stride;
  int32_t b_blocks;
  const float* b_up = nullptr;
};

// BLOCK_N 128: one block accumulator of 64 registers. BLOCK_N 256: the stage's MMAs run as two
// m64n128 halves (the B tile's rows 0-127, then 128-255: +16 KB, a whole number of swizzle
// atoms), each waited for and promoted with its own weight block's scale, so the block
// accumulator stays 64 registers beside the 128 of the tile (a warpgroup's MMAs pause during its
// promotions; the other warpgroup's fill the tensor cores meanwhile).
// `skew` (optional, the engine's Skew: Options::skew_stages): warpgroup 1 starts a tile once
// warpgroup 0 has promoted `stages` K blocks of it, so one's epilogue overlaps the other's MMAs
// (FC1's FP8 epilogue runs while the tensor cores would otherwise wait: notes/fp8.md).
// kPieceN: the MMAs' width, 128 (two halves of a 256-wide tile, a 64-register block accumulator)
// or 64 (quarters, 32 registers). kDepth: pieces in flight. 1: each piece's MMAs are waited for
// and promoted before the next piece's are issued (the warpgroup's tensor work pauses for the
// drain and the promotion; only the other warpgroup's MMAs fill it). 2 (quarters only: two
// 32-register block accumulators, the registers of one half): piece h + 1's MMAs are issued
// before piece h is waited for and promoted, so one warpgroup keeps the tensor cores fed through
// three of a stage's four promotions, at the price of A re-read from shared memory per 64 columns
// (at FP8's rate quarters need all of the shared-memory bandwidth: notes/fp8.md). Not across K
// blocks: waiting for the next stage (a bounded wait: divergent code) while a wgmma group is in
// flight makes ptxas serialize every wgmma (C7518, measured in the SASS).
// kOrdered: the two warpgroups take turns issuing pieces (named barriers kBarOrder + warpgroup:
// warpgroup 0 issues a piece, then warpgroup 1, then warpgroup 0 its next, ...), so that one's MMAs
// run while the other drains and promotes instead of both warpgroups' MMAs interleaving and both
// promoting at once. The consumers call scaled_turns_begin before their first tile and
// scaled_turns_end after their last (warpgroup 1's first turn is granted once and warpgroup 0
// takes the last grant once: granting per tile could let warpgroup 1's next grant reach barrier 0
// before warpgroup 0 took the previous one, one phase of arrivals from warpgroup 1 alone). Both
// warpgroups run the same tiles, so their turns match. An experiment (MOK_FP8_ORDERED_WARPGROUPS):
// bar.sync has no time bound, so a warpgroup that leaves its tile loop early (an expired wait)
// would leave the other waiting; before it could be a default the turns belong on mbarriers with
// bounded waits. A stagger is off with turns (the two would deadlock).
// The mainloop the FP8 kernels (grouped_fp8.cu, forward_kernel_fp8.cu) instantiate: m64n128
// halves, one in flight; built with the experiment options (CMake: MOK_FP8_PIPELINED_QUARTERS,
// MOK_FP8_ORDERED_WARPGROUPS) pipelined quarters and / or turns.
#if defined(MOK_FP8_PIPELINED_QUARTERS)
inline constexpr int kFp8PieceN = 64, kFp8Depth = 2;
#else
inline constexpr int kFp8PieceN = 128, kFp8Depth = 1;
#endif
#if defined(MOK_FP8_ORDERED_WARPGROUPS)
inline constexpr bool kFp8Ordered = true;
#else
inline constexpr bool kFp8Ordered = false;
#endif
__device__ __forceinline__ void scaled_turns_begin(int cwg) {
  if (cwg == 1) named_bar_arrive(kBarOrder + 0u, 256);  // warpgroup 0 goes first
}
__device__ __forceinline__ void scaled_turns_end(int cwg) {
  if (cwg == 0) named_bar_sync(kBarOrder + 0u, 256);  // warpgroup 1's last grant
}
template <class C, bool kGateUp = false, int kPieceN = 128, int kDepth = 1, bool kOrdered = false>
__device__ __forceinline__ void mma_tile_scaled(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg, uint32_t wt,
                                                float (&acc)[C::kAccRegs], const WaitBound& wb, const TileScales& sc,
                                                Skew<C>* skew = nullptr) {
  static_assert(std::is_same_v<typename C::Operand, OperandE4m3>, "block-scaled FP8: E4M3 operands");
  static_assert(kPieceN == 128 || kPieceN == 64, "m64n128 or m64n64 pieces");
  static_assert(kDepth == 1 || (kDepth == 2 && kPieceN == 64), "two pieces in flight: quarters only (registers)");
  constexpr int kHalves = C::kBlockN / 128;  // weight blocks (scales) of the tile
  constexpr int kPieces = C::kBlockN / kPieceN, kPart = kPieceN / 2;  // m64nN: N/2 accumulators
  const bool staggered = !kOrdered && skew != nullptr && skew->applies(t);  // (turns and a stagger would deadlock)
  uint64_t* skew_bar = sm.skew(skew != nullptr ? skew->tiles & 1u : 0u);
  const uint32_t skew_parity = skew != nullptr ? (skew->tiles >> 1) & 1u : 0u;
  if (staggered) {
    ++skew->tiles;
    if (cwg == 1) mbar_wait(skew_bar, skew_parity, wb, kSiteSkew);
  }
#pragma unroll
  for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  if (t.k_blocks == 0) return;
  // This thread's rows: r and r + 8 of its warpgroup's 64 (the accumulator layout, acc_row).
  const float* a0 = sc.a + int64_t(64 * cwg + acc_row(wt)) * sc.a_stride;
  const float* a1 = a0 + 8 * sc.a_stride;
  const uint32_t a_base = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b_base = smem_addr(sm.b(0));
  float part[kDepth][kPart];
  // Piece h's MMAs of stage s (its 128 K elements against B rows [h N, (h + 1) N)) into `pp`.
  const auto issue = [&](uint32_t s, int h, float (&pp)[kPart]) {
    const uint32_t as = a_base + s * kATileBytes;
    const uint32_t bs = b_base + s * C::kBTileBytes + uint32_t(h) * uint32_t(kPieceN) * uint32_t(kKBytes);
    if (kOrdered) named_bar_sync(kBarOrder + uint32_t(cwg), 256);  // our turn
    fence_operands(pp);
    wgmma_fence();
#pragma unroll
    for (int k32 = 0; k32 < C::kBlockK / C::Operand::kStepK; ++k32)
      C::Operand::template mma<kPieceN, false, false>(pp, desc_k_major(as, k32), desc_k_major(bs, k32),
                                                  k32 > 0 ? 1u : 0u);
    wgmma_commit();
    if (kOrdered) named_bar_arrive(kBarOrder + uint32_t(cwg ^ 1), 256);  // the other's turn
    fence_operands(pp);
  };
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    // The block's scales, loaded while the stage arrives and its MMAs run.
    const float sa0 = __ldg(a0 + kb), sa1 = __ldg(a1 + kb);
    float sb[kHalves], sb_up = 0.0f;
    if constexpr (kGateUp) {
      sb_up = __ldg(sc.b_up + kb);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) sb[h] = __ldg(sc.b + kb);  // one gate block for the whole tile
    } else {
#pragma unroll
      for (int h = 0; h < kHalves; ++h) sb[h] = h < sc.b_blocks ? __ldg(sc.b + h * sc.b_stride + kb) : 0.0f;
    }
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      float(&pp)[kPart] = part[h % kDepth];
      if (kDepth == 1 || h == 0) issue(s, h, pp);
      const bool ahead = kDepth == 2 && h + 1 < kPieces;  // the next piece goes in before this one's wait
      if (ahead) issue(s, h + 1, part[(h + 1) % kDepth]);
      if (ahead)
        wgmma_wait<1>();  // this piece's group done; the next one's may still run
      else
        wgmma_wait<0>();
      fence_operands(pp);
      if (h == kPieces - 1) release_stage<C>(sm, s);  // every piece's MMAs of this stage have completed
      const int wblk = h * kPieceN / 128;  // the piece's weight block
      const float s0 = sa0 * sb[wblk], s1 = sa1 * sb[wblk];
      const float u0 = sa0 * sb_up, u1 = sa1 * sb_up;
#pragma unroll
      for (int j = 0; j < kPart / 4; ++j) {
        const bool up = kGateUp && (j % 8) >= 4;  // (a piece is 64 or 128 columns: j % 8 is the packed position)
        float* d = acc + kPart * h + 4 * j;
        d[0] = fmaf(pp[4 * j], up ? u0 : s0, d[0]);
        d[1] = fmaf(pp[4 * j + 1], up ? u0 : s0, d[1]);
        d[2] = fmaf(pp[4 * j + 2], up ? u1 : s1, d[2]);
        d[3] = fmaf(pp[4 * j + 3], up ? u1 : s1, d[3]);
      }
    }
    if (staggered && cwg == 0 && kb == skew->stages - 1 && wt == 0) mbar_arrive(skew_bar);
    ps.advance();
  }
}

// FC1's epilogue in FP8: the 256-wide packed tile holds 128 intermediate columns, so each row's
// h values of the tile are one 1 x 128 block. Per thread (rows r and r + 8, acc_row): the gate
// value of n8 block j (j % 8 < 4) pairs with the up value of block j + 4 (32 packed columns on,
// the same registers' places), h = rnd(silu(rnd(g)) * rnd(u)) (FC1's bits), the row's maximum over
// the four threads of a quad (which hold all of a row's columns), its scale amax / 448, and the
// E4M3 codes by the hardware conversion (fp8_cvt.cuh), two adjacent columns per 2-byte store; the
// quad's first thread stores the scale. Both consumer warpgroups run this while the tensor cores
// wait, so it is kept to a few instructions per value.
// The destinations are arguments (h's codes [rows, inter] and scales [rows, inter / 128] from the
// tile's first row `out_row`; `b_n`: the tile's first packed column), so the grouped form and a
// megakernel's task share it.
__device__ __forceinline__ void epilogue_fc1_fp8(const float (&acc)[128], int cwg, uint32_t wt, int64_t out_row,
                                                 int64_t b_n, uint8_t* hq, float* h_scales, int64_t inter) {
  const int64_t blocks = inter / 128;
  const int64_t row0 = out_row + 64 * cwg + acc_row(wt);
  const int64_t i0 = b_n / 2 + acc_col(wt);  // this thread's first intermediate column
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float h[32];
    float amax = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int j = 8 * (jj / 4) + jj % 4;  // a gate block; its up block is j + 4
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float g = bf16_round(acc[4 * j + 2 * rr + c]), u = bf16_round(acc[4 * (j + 4) + 2 * rr + c]);
        h[2 * jj + c] = bf16_round(swiglu_of_bf16(g, u));
        amax = mok::fp8::amax_update(amax, h[2 * jj + c]);
      }
    }
    amax = mok::fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = mok::fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float s = mok::fp8::block_scale(amax, mok::fp8::ScaleRule::Fp32), inv = mok::fp8::block_inverse(s);
    const int64_t row = row0 + 8 * rr;
    if ((wt & 3u) == 0) h_scales[row * blocks + b_n / 256] = s;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t i = i0 + 32 * (jj / 4) + 8 * (jj % 4);
      *reinterpret_cast<uint16_t*>(hq + row * inter + i) = block_encode_inv2(h[2 * jj], h[2 * jj + 1], inv);
    }
  }
}

}  // namespace mok::gemm::engine
