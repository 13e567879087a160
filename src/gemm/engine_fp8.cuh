// mok — the engine's block-scaled FP8 mainloop (issue 22, recipe 1: DeepSeek-V3's block scaling).
//
// The FP8 operand type (OperandE4m3, engine_mainloop.cuh) holds 128 K elements per stage, which is
// exactly one scale block along K: per stage the consumer warpgroup runs the stage's four k32
// wgmmas into a block accumulator `part` starting from zero, waits for them, releases the stage
// and promotes: acc += part * (a_scale[row] * b_scale), one fp32 fma per accumulator, with the
// scales of its two rows (1 x 128 activation blocks) and of the tile's 128 weight columns (128 x
// 128 weight blocks). The tensor cores' FP8 accumulation (fewer bits than fp32) thus spans 128
// products only, and the sum over K is in fp32. Two accumulator sets need 2 x 64 registers:
// BLOCK_N 128 only. The two consumer warpgroups run the same tile, so one's promotion overlaps
// the other's MMAs.
#pragma once

#include <type_traits>

#include "gemm/engine.cuh"

namespace mok::gemm::engine {

// The fp32 scales one output tile reads: A's per row at the tile's first row (`a`, rows `a_stride`
// floats apart, consecutive along K blocks) and B's for the tile's 128 columns (`b`, consecutive
// along K blocks).
struct TileScales {
  const float* a;
  int64_t a_stride;
  const float* b;
};

template <class C>
__device__ __forceinline__ void mma_tile_scaled(const Smem<C>& sm, PipeState<C>& ps, const Tile& t, int cwg, uint32_t wt,
                                                float (&acc)[C::kAccRegs], const WaitBound& wb, const TileScales& sc) {
  static_assert(std::is_same_v<typename C::Operand, OperandE4m3> && C::kBlockN == 128,
                "block-scaled FP8: E4M3 operands, BLOCK_N 128 (two accumulator sets)");
#pragma unroll
  for (int i = 0; i < C::kAccRegs; ++i) acc[i] = 0.0f;
  if (t.k_blocks == 0) return;
  // This thread's rows: r and r + 8 of its warpgroup's 64 (the accumulator layout, acc_row).
  const float* a0 = sc.a + int64_t(64 * cwg + acc_row(wt)) * sc.a_stride;
  const float* a1 = a0 + 8 * sc.a_stride;
  const uint32_t a_base = smem_addr(sm.a(0)) + uint32_t(cwg) * kChunkBytes;
  const uint32_t b_base = smem_addr(sm.b(0));
  float part[C::kAccRegs];
  for (int kb = 0; kb < t.k_blocks; ++kb) {
    const uint32_t s = ps.stage;
    // The block's scales, loaded while the stage arrives and its MMAs run.
    const float sa0 = __ldg(a0 + kb), sa1 = __ldg(a1 + kb), sb = __ldg(sc.b + kb);
    mbar_wait(sm.full(s), ps.phase, wb, kSiteConsumerFull);
    const uint32_t as = a_base + s * kATileBytes;
    const uint32_t bs = b_base + s * C::kBTileBytes;
    fence_operands(part);
    wgmma_fence();
#pragma unroll
    for (int k32 = 0; k32 < C::kBlockK / C::Operand::kStepK; ++k32)
      C::Operand::template mma<C::kBlockN, false, false>(part, desc_k_major(as, k32), desc_k_major(bs, k32),
                                                         k32 > 0 ? 1u : 0u);
    wgmma_commit();
    fence_operands(part);
    wgmma_wait<0>();
    fence_operands(part);
    release_stage<C>(sm, s);
    const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
    for (int j = 0; j < C::kAccRegs / 4; ++j) {
      acc[4 * j] = fmaf(part[4 * j], s0, acc[4 * j]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
    }
    ps.advance();
  }
}

}  // namespace mok::gemm::engine
