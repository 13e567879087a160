// mok — grouped GEMMs with block-scaled FP8 operands, one persistent kernel over
// Cfg<128 | 256, OperandE4m3> whose consumers run the scaled mainloop (engine_fp8.cuh), in four
// modes: Form::Fp8Plain (gemm::plan_fp8_grouped; the bf16 tile stored by engine_epilogue.cuh, or
// with plan_fp8_grouped_scatter each row at its token's slot: the FP8 backward's FC1 dgrad) and
// Form::Fp8DgradSwiGLU (gemm::plan_fp8_dgrad_swiglu: FormDgradSwiGLU's epilogue on the FP8 tile),
// Form::Fp8Fc1 (gemm::plan_fp8_fc1; B = the gate and up weights in the packed order, SwiGLU and h
// quantized per 1 x 128 by engine_fp8.cuh's FC1 epilogue) — all on grouped_kernel.cuh's
// M-grouped schedule — and Form::Fp8Wgrad (gemm::plan_fp8_wgrad: the K-grouped schedule over the
// experts' rows, per-column scales, FormWgrad's epilogue). One translation unit for all four.
#include <atomic>

#include "common/cuda_check.h"
#include "common/fp8_format.h"
#include "gemm/engine_fp8.cuh"
#include "gemm/grouped_kernel.cuh"
#include "gemm/launchers.h"

namespace mok::gemm {
namespace engine {
namespace {

// Fc1Mx: FC1 with h as re-blocked MXFP8; PlainScatter: Plain whose rows go to their slots
// (plan_fp8_grouped_scatter). New modes go last: scripts name the others by number.
enum class Fp8Mode { Plain, Fc1, Wgrad, DgradSwiGLU, Fc1Mx, PlainScatter };

// The K-grouped tiles' scales sit per 128-row block of the routed rows, so an expert's segment
// with rows must start on a block: one that does not is not computed (producer and consumers
// alike: the same tiles, the same stages) and is recorded in the error word — which also ends
// every wait still pending on the GPU, so the whole call's results are then undefined (a loud
// failure, as for an expired wait; the layer's segments are always aligned). An expert without
// rows is never misaligned, wherever its begin points.
__device__ __forceinline__ bool fp8_segment_misaligned(Tile& t) {
  if (t.k_blocks == 0 || (t.k_begin & 127) == 0) return false;
  t.k_blocks = 0;
  return true;
}

// The FP8 wgrad's stage scales (Cfg::kStageScales): per K block the tile's BLOCK_N column scales
// (its B rows') and its 128 row scales (A's), by the producer's thread beside the operands, on
// the stage's barrier. Tensor-map loads (fp32, unswizzled), not plain bulk copies: the same
// hand-off, but racecheck orders a plain cp.async.bulk's writes (which it attributes to the
// issuing thread) against the consumers' shared-memory reads through no mbarrier, and reports
// every stage as a hazard; the tensor copies are the engine's, as for the operands. A 256-wide
// tile at the matrix's right edge gets zeros for its columns past n (never stored).
template <class CF>
struct WgradStageScales {
  const CUtensorMap* map_sb;  // B's column scales, {n, K blocks}, box {BLOCK_N, 1}
  const CUtensorMap* map_sa;  // A's row scales, {m_out, K blocks}, box {128, 1}
  int32_t col, row, kb0;      // the tile's first column and row; the expert's first K block
  const Smem<CF>* sm;
  __device__ __forceinline__ uint32_t bytes() const { return 4u * uint32_t(CF::kBlockN) + 512u; }
  __device__ __forceinline__ void operator()(uint32_t stage, int kb, uint64_t* full) const {
    float* dst = sm->scales(stage);
    tma_load_2d(dst, map_sb, full, col, kb0 + kb);
    tma_load_2d(dst + CF::kBlockN, map_sa, full, row, kb0 + kb);
  }
};
template <class CF>
__device__ __forceinline__ WgradStageScales<CF> wgrad_stage_scales(const Smem<CF>& sm, const Tile& t,
                                                                   const CUtensorMap* map_sa,
                                                                   const CUtensorMap* map_sb) {
  return WgradStageScales<CF>{map_sb, map_sa, t.b_n, t.out_row, t.k_begin / 128, &sm};
}

template <class CF, Fp8Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_b_half, const __grid_constant__ CUtensorMap map_d0,
                       const __grid_constant__ CUtensorMap map_d1, const __grid_constant__ CUtensorMap map_sa,
                       const __grid_constant__ CUtensorMap map_sb, const KernelParams p) {
  constexpr bool kFc1 = kMode == Fp8Mode::Fc1 || kMode == Fp8Mode::Fc1Mx, kWgrad = kMode == Fp8Mode::Wgrad;
  static_assert(kMode != Fp8Mode::DgradSwiGLU || CF::kBlockN == 256, "the dgrad + SwiGLU epilogue: 256-wide tiles");
  static_assert(!kFc1 || CF::kBlockN == 256, "FC1 in FP8: 256-wide packed tiles (one h block per row)");
  using Schedule = std::conditional_t<kWgrad, KGroupedSchedule<CF>, MGroupedSchedule<CF>>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem<CF> sm = smem_view<CF>(smem_raw);
  if (threadIdx.x == 0) init_barriers(sm);
  __syncthreads();
  const WaitBound wb{p.error, p.wait_limit_ns};
  bool shared = false, dummy = false;
  Tile t;
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x / 32u == 0 && elect_one()) {
      prefetch_tensor_map(&map_a);
      prefetch_tensor_map(&map_b);
      if (kFc1) prefetch_tensor_map(&map_b_half);
      if (kWgrad) {
        prefetch_tensor_map(&map_sa);
        prefetch_tensor_map(&map_sb);
      }
      PipeState<CF> ps;
      Schedule sched(p);
      while (sched.next(t, shared, dummy)) {  // FC1: B from the gate and up maps (32-row boxes)
        bool ok;
        if constexpr (kWgrad) {
          fp8_segment_misaligned(t);
          ok = produce_tile<CF, false, false>(sm, ps, t, &map_a, &map_b, wb, &map_b_half, false, 0u, false,
                                              wgrad_stage_scales(sm, t, &map_sa, &map_sb));
        } else {
          ok = produce_tile<CF, false, false>(sm, ps, t, &map_a, &map_b, wb, &map_b_half, false, 0u, kFc1);
        }
        if (!ok) break;  // a wait expired
      }
      drain_stages(sm, ps, wb);
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int cwg = int(threadIdx.x / 128u) - 1;
  const uint32_t wt = threadIdx.x % 128u;
  if (!kFc1 && wt == 0 && cwg == 0) {
    prefetch_tensor_map(&map_d0);
    if (kWgrad) prefetch_tensor_map(&map_d1);
  }
  PipeState<CF> ps;
  EpiState es;
  Skew<CF> skew;  // Options::skew_stages (0: off)
  skew.stages = p.skew_stages;
  float acc[CF::kAccRegs];
  Schedule sched(p);
  const int64_t kb = p.k_blocks, n_blocks = p.n / 128;
  while (sched.next(t, shared, dummy)) {
    if constexpr (kFc1) {
      // The tile's 128 intermediate columns: one 128 x 128 block of W_gate and one of W_up along N.
      const int64_t wblock = (int64_t(t.b_batch) * (p.n / 256) + t.b_n / 256) * kb;
      TileScales sc{p.scale_a + int64_t(t.a_m) * kb, kb, p.scale_b + wblock, 0, 1};
      sc.b_up = p.scale_b_up + wblock;
      mma_tile_scaled<CF, BScale::GateUp>(sm, ps, t, cwg, wt, acc, wb, sc, &skew);
      epilogue_fc1_fp8<kMode == Fp8Mode::Fc1Mx>(acc, cwg, wt, t.out_row, t.b_n, static_cast<uint8_t*>(p.fc1_h),
                                                p.scale_h, p.n / 2, static_cast<uint16_t*>(p.fc1_gu));
    } else if constexpr (kWgrad) {
      if (fp8_segment_misaligned(t) && wt == 0 && cwg == 0 && p.error != nullptr)
        atomicCAS(p.error, 0u, kSiteFp8Segment);
      // Scales per 128 x 1 block: with the stages (wgrad_stage_scales); two block accumulators.
      // The expert a previous call carried (Fp8WgradArgs::carry_in) continues its fp32 sums.
      const bool acc_in = FormWgrad<CF>::load_carry(t, uint32_t(cwg) * 128u + wt, acc, p);
      if constexpr (CF::kBlockN == 128)
        mma_tile_columns_pipelined<CF>(sm, ps, t, cwg, wt, acc, wb, acc_in);
      else
        mma_tile_scaled<CF, BScale::Column>(sm, ps, t, cwg, wt, acc, wb, TileScales{}, &skew, acc_in);
      FormWgrad<CF>::epilogue(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
    } else {
      // The tile's rows' scales and its expert's scales for columns [b_n, b_n + 128).
      const TileScales sc{p.scale_a + int64_t(t.a_m) * kb, kb,
                          p.scale_b + (int64_t(t.b_batch) * n_blocks + t.b_n / 128) * kb, kb,
                          int32_t(n_blocks - t.b_n / 128)};
      mma_tile_scaled<CF, BScale::Block>(sm, ps, t, cwg, wt, acc, wb, sc, &skew);
      if constexpr (kMode == Fp8Mode::DgradSwiGLU)
        FormDgradSwiGLU<CF>::epilogue(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
      else if constexpr (kMode == Fp8Mode::PlainScatter)
        epilogue_scatter_rows<CF>(sm, es, cwg, wt, acc, p.scatter_rank, p.scatter_slot, p.scatter_to,
                                  p.scatter_abort, p.error, p.scatter_row_base, t.out_row, t.b_n, p.n);
      else
        epilogue_store<CF>(sm, es, cwg, wt, acc, &map_d0, t.out_row, t.b_n, p.n);
    }
  }
  epi_finish(wt == 0);
}

}  // namespace
}  // namespace engine

namespace {
template <int kBN, engine::Fp8Mode kMode, int kStageScales = 0>
void launch_fp8_cfg(const Plan& plan, cudaStream_t stream) {
  using CF = engine::Cfg<kBN, engine::OperandE4m3, kStageScales>;
  auto* kernel = &engine::fp8_grouped_kernel<CF, kMode>;
  static std::atomic<unsigned long long> configured{0};
  mok::detail::set_smem_once(kernel, int(CF::kSmemBytes), configured);
  kernel<<<unsigned(plan.grid), engine::kThreads, CF::kSmemBytes, stream>>>(plan.map_a, plan.map_b, plan.map_b_half,
                                                                           plan.map_d0, plan.map_d1, plan.map_sa, plan.map_sb,
                                                                           plan.params);
  MOK_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void detail::launch_fp8_grouped(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  using engine::Fp8Mode;
  if (plan.form == Form::Fp8Fc1 && plan.params.h_mx)
    launch_fp8_cfg<256, Fp8Mode::Fc1Mx>(plan, stream);
  else if (plan.form == Form::Fp8Fc1)
    launch_fp8_cfg<256, Fp8Mode::Fc1>(plan, stream);
  else if (plan.form == Form::Fp8DgradSwiGLU)
    launch_fp8_cfg<256, Fp8Mode::DgradSwiGLU>(plan, stream);
  else if (plan.form == Form::Fp8Wgrad && plan.block_n == 256)
    launch_fp8_cfg<256, Fp8Mode::Wgrad, 384>(plan, stream);  // (3 stages beside the scales' areas)
  else if (plan.form == Form::Fp8Wgrad)
    launch_fp8_cfg<128, Fp8Mode::Wgrad, 256>(plan, stream);
  else if (plan.params.scatter_to != nullptr && plan.block_n == 256)
    launch_fp8_cfg<256, Fp8Mode::PlainScatter>(plan, stream);
  else if (plan.params.scatter_to != nullptr)
    launch_fp8_cfg<128, Fp8Mode::PlainScatter>(plan, stream);
  else if (plan.block_n == 256)
    launch_fp8_cfg<256, Fp8Mode::Plain>(plan, stream);
  else
    launch_fp8_cfg<128, Fp8Mode::Plain>(plan, stream);
}

}  // namespace mok::gemm
