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

// How a tile's B operand is scaled (the recipe's blocks of the B matrix along N):
//   Block: per 128 x 128 block (weights, forward and dgrad): one scale per 128 columns and K block;
//   GateUp: FC1's packed gate/up B — the tile's 128 intermediate columns are one 128 x 128 block of
//     W_gate and one of W_up, so in the packed order accumulator n8 block j takes the up scale when
//     j % 8 >= 4 (32 gate then 32 up columns per 64);
//   Column: per column and K block (the wgrad's 128 x 1 token blocks: both operands' scales run
//     along their M / N index), so each accumulator column has its own scale.
enum class BScale { Block, GateUp, Column };

// The fp32 scales one output tile reads (Block, GateUp). A's: one per tile row and K block, at
// a + row * a_row + kb (activations per 1 x 128: a_row = k_blocks). B's (Block): the tile's first
// 128 columns' at b + kb, the next 128 columns' at b + b_stride, `b_blocks` of them inside the
// matrix (a 256-wide tile at its right edge may have one: its other half reads no scale and is
// promoted with 0; its columns are not stored). GateUp: W_gate's at b + kb, W_up's at b_up + kb.
// Column reads none of these: each K block's scales come with its stage (Cfg::kStageScales: the
// tile's BLOCK_N column scales, then its 128 row scales; the producer's tensor-map loads), since a
// thread needs 32 column scales per half and block, which loads from global memory at every
// promotion made the tensor cores wait (measured: 474 vs 712 TF/s of the bf16 wgrad).
struct TileScales {
  const float* a = nullptr;
  int64_t a_row = 0;
  const float* b = nullptr;
  int64_t b_stride = 0;
  int32_t b_blocks = 0;
  const float* b_up = nullptr;
};

// The stage's MMAs run as m64n128 halves (BLOCK_N 256: the B tile's rows 0-127, then 128-255: +16
// KB, a whole number of swizzle atoms; BLOCK_N 128: one half), each into a 64-register block
// accumulator `part` from zero, waited for and promoted — acc += part * scale_a(row) *
// scale_b(column) — before the next half is issued, so the block accumulator stays 64 registers
// beside the tile's 128 (a warpgroup's MMAs pause during its promotions; the other warpgroup's
// fill the tensor cores meanwhile). Measured against the alternatives (m64n64 quarters with two
// pieces in flight; the two warpgroups taking turns per piece): halves were faster in every
// grouped form and megakernel case (bench/results/fp8-pieces-*-h200x1.json, notes/fp8.md).
// Not pipelined across K blocks here: in the quarters experiment, waiting for the next stage
// while a wgmma group was in flight made ptxas serialize every wgmma (C7518, seen in the SASS);
// mma_tile_columns_pipelined below does wait with one group in flight, and its SASS keeps the
// groups asynchronous (depbar 1), so the cause was that experiment's structure, not the wait.
// `skew` (optional, the engine's Skew: Options::skew_stages): warpgroup 1 starts a tile once
// warpgroup 0 has promoted `stages` K blocks of it, so one's epilogue overlaps the other's MMAs
// (FC1's FP8 epilogue runs while the tensor cores would otherwise wait: notes/fp8.md).
template <class C, BScale kB = BScale::Block>
__device__ __forceinline__ void mma_tile_scaled(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg, uint32_t wt,
                                                float (&acc)[C::kAccRegs], const WaitBound& wb, const TileScales& sc,
                                                Skew<C>* skew = nullptr, bool acc_in = false) {
  static_assert(std::is_same_v<typename C::Operand, OperandE4m3>, "block-scaled FP8: E4M3 operands");
  static_assert(kB != BScale::Column || C::kStageScales >= C::kBlockN + 128,
                "per-column scales come with the stage: its columns' then its rows' (Cfg::kStageScales)");
  constexpr int kHalves = C::kBlockN / 128;  // m64n128 pieces = weight blocks of the tile
  const bool staggered = skew != nullptr && skew->applies(t);
  uint64_t* skew_bar = sm.skew(skew != nullptr ? skew->tiles & 1u : 0u);
  const uint32_t skew_parity = skew != nullptr ? (skew->tiles >> 1) & 1u : 0u;
  if (staggered) {
    ++skew->tiles;
    if (cwg == 1) mbar_wait(skew_bar, skew_parity, wb, kSiteSkew);
  }
  if (!acc_in) {  // (acc_in: acc holds the sums an earlier call carried, FormWgrad::load_carry)
#pragma unroll
    for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  }
  if (t.k_blocks == 0) return;
  // This thread's rows: r and r + 8 of its warpgroup's 64 (the accumulator layout, acc_row); its
  // columns (Column): 2 adjacent ones per n8 block from acc_col.
  const float* a0 = kB == BScale::Column ? nullptr : sc.a + int64_t(64 * cwg + acc_row(wt)) * sc.a_row;
  const float* a1 = kB == BScale::Column ? nullptr : a0 + 8 * sc.a_row;
  const uint32_t a_base = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b_base = smem_addr(sm.b(0));
  float part[64];
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    // The block's scales, loaded while the stage arrives and its MMAs run (Column: from the stage,
    // once it has arrived).
    float sa0 = 0.0f, sa1 = 0.0f;
    if constexpr (kB != BScale::Column) sa0 = __ldg(a0 + kb), sa1 = __ldg(a1 + kb);
    float sb[kHalves], sb_up = 0.0f;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      if constexpr (kB == BScale::GateUp)
        sb[h] = __ldg(sc.b + kb);  // one gate block for the whole tile
      else if constexpr (kB == BScale::Block)
        sb[h] = h < sc.b_blocks ? __ldg(sc.b + h * sc.b_stride + kb) : 0.0f;
    }
    if constexpr (kB == BScale::GateUp) sb_up = __ldg(sc.b_up + kb);
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    const uint32_t stage_scales = smem_addr(sm.scales(s));
    if constexpr (kB == BScale::Column) {
      const uint32_t row = uint32_t(C::kBlockN + 64 * cwg + acc_row(wt));
      sa0 = lds_f32(stage_scales + 4u * row);
      sa1 = lds_f32(stage_scales + 4u * (row + 8u));
    }
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint32_t as = a_base + s * kATileBytes;
      const uint32_t bs = b_base + s * C::kBTileBytes + uint32_t(h) * 128u * uint32_t(kKBytes);
      fence_operands(part);
      wgmma_fence();
#pragma unroll
      for (int k32 = 0; k32 < C::kBlockK / C::Operand::kStepK; ++k32)
        C::Operand::template mma<128, false, false>(part, desc_k_major(as, k32), desc_k_major(bs, k32),
                                                    k32 > 0 ? 1u : 0u);
      wgmma_commit();
      fence_operands(part);
      wgmma_wait<0>();
      fence_operands(part);
      // Every half's MMAs of this stage have completed (Column: its scales are read below first).
      if (kB != BScale::Column && h == kHalves - 1) release_stage<C>(sm, s);
      float* d = acc + 64 * h;
      if constexpr (kB == BScale::Column) {
        // The half's column scales from the stage (the producer's tensor-map load: past the
        // matrix's edge they are zeros, and those columns are not stored).
        const uint32_t bk = stage_scales + 4u * uint32_t(128 * h + acc_col(wt));
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 b2 = lds_f32x2(bk + 32u * uint32_t(j));
          d[4 * j] = fmaf(part[4 * j] * sa0, b2.x, d[4 * j]);
          d[4 * j + 1] = fmaf(part[4 * j + 1] * sa0, b2.y, d[4 * j + 1]);
          d[4 * j + 2] = fmaf(part[4 * j + 2] * sa1, b2.x, d[4 * j + 2]);
          d[4 * j + 3] = fmaf(part[4 * j + 3] * sa1, b2.y, d[4 * j + 3]);
        }
        if (h == kHalves - 1) {
          __syncwarp();  // every lane's reads of the stage's scales before its warp's arrival
          release_stage<C>(sm, s);
        }
      } else {
        const float s0 = sa0 * sb[h], s1 = sa1 * sb[h];
        const float u0 = sa0 * sb_up, u1 = sa1 * sb_up;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const bool up = kB == BScale::GateUp && (j % 8) >= 4;  // j % 8: the packed position within 64 columns
          d[4 * j] = fmaf(part[4 * j], up ? u0 : s0, d[4 * j]);
          d[4 * j + 1] = fmaf(part[4 * j + 1], up ? u0 : s0, d[4 * j + 1]);
          d[4 * j + 2] = fmaf(part[4 * j + 2], up ? u1 : s1, d[4 * j + 2]);
          d[4 * j + 3] = fmaf(part[4 * j + 3], up ? u1 : s1, d[4 * j + 3]);
        }
      }
    }
    if (staggered && cwg == 0 && kb == skew->stages - 1 && wt == 0) mbar_arrive(skew_bar);
    ps.advance();
  }
}

// The wgrad's mainloop with two block accumulators (128-wide tiles, BScale::Column, the scales
// with the stages): stage kb + 1's MMAs are issued into one block accumulator before stage kb's,
// in the other, is waited for and promoted, so each warpgroup's own MMAs run through its
// promotions (which, at two instructions per accumulator and a shared-memory load per two, the
// other warpgroup's MMAs alone do not cover: both consume the same stages and tend to promote at
// once). 64 + 2 x 64 accumulator registers. Blocks are added to acc in increasing kb, as in
// mma_tile_scaled: the same bits.
template <class C>
__device__ __forceinline__ void mma_tile_columns_pipelined(const Smem<C>& sm, PipeState<C>& ps, const Tile& t,
                                                           int cwg, uint32_t wt, float (&acc)[C::kAccRegs],
                                                           const WaitBound& wb, bool acc_in = false) {
  static_assert(std::is_same_v<typename C::Operand, OperandE4m3> && C::kBlockN == 128 &&
                    C::kStageScales >= C::kBlockN + 128,
                "128-wide FP8 tiles whose stages carry their scales");
  if (!acc_in) {
#pragma unroll
    for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  }
  if (t.k_blocks == 0) return;
  const uint32_t a_base = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b_base = smem_addr(sm.b(0));
  const uint32_t row = uint32_t(C::kBlockN + 64 * cwg + acc_row(wt)), col = uint32_t(acc_col(wt));
  float p0[64], p1[64];
  // Waits for the next stage and issues its MMAs into pp; returns the stage.
  const auto start = [&](float (&pp)[64]) {
    const uint32_t s = ps.stage;
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    const uint32_t as = a_base + s * kATileBytes, bs = b_base + s * C::kBTileBytes;
    fence_operands(pp);
    wgmma_fence();
#pragma unroll
    for (int k32 = 0; k32 < C::kBlockK / C::Operand::kStepK; ++k32)
      C::Operand::template mma<128, false, false>(pp, desc_k_major(as, k32), desc_k_major(bs, k32), k32 > 0 ? 1u : 0u);
    wgmma_commit();
    fence_operands(pp);
    ps.advance();
    return s;
  };
  // acc += pp * scale_row * scale_col with stage s's scales, then the stage is free.
  const auto promote = [&](float (&pp)[64], uint32_t s) {
    fence_operands(pp);
    const uint32_t sc = smem_addr(sm.scales(s));
    const float sa0 = lds_f32(sc + 4u * row), sa1 = lds_f32(sc + 4u * (row + 8u));
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 b2 = lds_f32x2(sc + 4u * (col + 8u * uint32_t(j)));
      acc[4 * j] = fmaf(pp[4 * j] * sa0, b2.x, acc[4 * j]);
      acc[4 * j + 1] = fmaf(pp[4 * j + 1] * sa0, b2.y, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(pp[4 * j + 2] * sa1, b2.x, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(pp[4 * j + 3] * sa1, b2.y, acc[4 * j + 3]);
    }
    __syncwarp();  // every lane's reads of the stage's scales before its warp's arrival
    release_stage<C>(sm, s);
  };
  uint32_t s0 = start(p0), s1 = 0;  // block 0 in p0
  for (int kb = 1;; kb += 2) {
    if (kb >= t.k_blocks) {  // block kb - 1 (p0) was the last
      wgmma_wait<0>();
      promote(p0, s0);
      return;
    }
    s1 = start(p1);  // block kb
    wgmma_wait<1>();  // block kb - 1's MMAs are done
    promote(p0, s0);
    if (kb + 1 >= t.k_blocks) {  // block kb (p1) was the last
      wgmma_wait<0>();
      promote(p1, s1);
      return;
    }
    s0 = start(p0);  // block kb + 1
    wgmma_wait<1>();
    promote(p1, s1);
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
// megakernel's task share it. With gu (the grouped form's Fp8Fc1Args::gu; a megakernel passes
// none, and the branch folds away), the tile's rnd(g), rnd(u) are stored too, bf16 pairs in the
// packed order [rows, 2 inter] as the bf16 FC1 stores them: what the backward's SwiGLU' reads.
// kMx (Fp8Fc1Args::h_mx): h as MXFP8 re-blocked to the 1 x 128 block (gemm::quantize_mxfp8_reblocked's
// rule): the thread's 8 values of each 32-column MX block (jj / 4) and the quad's other 24 give
// that block's E8M0 scale, the largest of the four is the block's scale (2^e, or NaN), and each
// code is the MX code re-encoded at it.
template <bool kMx = false>
__device__ __forceinline__ void epilogue_fc1_fp8(const float (&acc)[128], int cwg, uint32_t wt, int64_t out_row,
                                                 int64_t b_n, uint8_t* hq, float* h_scales, int64_t inter,
                                                 uint16_t* gu = nullptr) {
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
    float s = 0.0f, inv = 0.0f;
    uint8_t mx_sc[4] = {0, 0, 0, 0};
    float mx_f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool mx_nan = false;
    if constexpr (kMx) {
      uint32_t top = 0;
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        float m = 0.0f;
#pragma unroll
        for (int q = 0; q < 8; ++q) m = mok::fp8::amax_update(m, h[8 * g + q]);
        m = mok::fp8::amax_update(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = mok::fp8::amax_update(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx_sc[g] = mok::fp8::mxfp8_scale_code(m);
        top = max(top, uint32_t(mx_sc[g]));
      }
      mx_nan = top == mok::fp8::kE8m0NaN;
      s = mx_nan ? __uint_as_float(0x7fc00000u) : mok::fp8::e8m0_decode(uint8_t(top));
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        mx_f[g] = mx_shift(mx_sc[g], top);
      }
    } else {
      amax = mok::fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = mok::fp8::amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      s = mok::fp8::block_scale(amax, mok::fp8::ScaleRule::Fp32);
      inv = mok::fp8::block_inverse(s);
    }
    const int64_t row = row0 + 8 * rr;
    if (gu != nullptr) {
      uint16_t* g_row = gu + row * 2 * inter + b_n + acc_col(wt);
#pragma unroll
      for (int j = 0; j < 32; ++j)  // n8 block j: packed columns b_n + 8 j + acc_col, + 1
        *reinterpret_cast<uint32_t*>(g_row + 8 * j) =
            pack_bf16x2(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);  // (cvt.rn: rnd(g), rnd(u))
    }
    if ((wt & 3u) == 0) h_scales[row * blocks + b_n / 256] = s;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t i = i0 + 32 * (jj / 4) + 8 * (jj % 4);
      uint16_t codes;
      if constexpr (kMx) {
        const int g = jj / 4;
        // The MX codes (fp8::mxfp8_encode, by the hardware conversion: the same bits), moved to
        // the block's scale (mx_reblocked2: the re-blocking rule by conversions).
        codes = mx_nan ? uint16_t(0x7f7f)
                       : mx_reblocked2(h[2 * jj], h[2 * jj + 1], mok::fp8::mxfp8_inv_scale(mx_sc[g]), mx_f[g]);
      } else {
        codes = block_encode_inv2(h[2 * jj], h[2 * jj + 1], inv);
      }
      *reinterpret_cast<uint16_t*>(hq + row * inter + i) = codes;
    }
  }
}

}  // namespace mok::gemm::engine
