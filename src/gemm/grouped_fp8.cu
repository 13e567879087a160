// mok — grouped GEMMs with block-scaled FP8 operands, one persistent kernel over
// Cfg<128 | 256, OperandE4m3> whose consumers run the scaled mainloop (engine_fp8.cuh), in four
// modes: Form::Fp8Plain (gemm::plan_fp8_grouped; the bf16 tile stored by engine_epilogue.cuh) and
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

enum class Fp8Mode { Plain, Fc1, Wgrad, DgradSwiGLU };

// The K-grouped tiles' scales sit per 128-row block of the routed rows, so an expert's segment
// must start on a block: one that does not is computed as empty (its gradient written 0) and
// recorded in the error word, by producer and consumers alike (the same tiles, the same stages).
__device__ __forceinline__ bool fp8_segment_misaligned(Tile& t) {
  if ((t.k_begin & 127) == 0) return false;
  t.k_blocks = 0;
  return true;
}

template <class CF, Fp8Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_b_half, const __grid_constant__ CUtensorMap map_d0,
                       const __grid_constant__ CUtensorMap map_d1, const KernelParams p) {
  constexpr bool kFc1 = kMode == Fp8Mode::Fc1, kWgrad = kMode == Fp8Mode::Wgrad;
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
      PipeState<CF> ps;
      Schedule sched(p);
      while (sched.next(t, shared, dummy)) {  // FC1: B from the gate and up maps (32-row boxes)
        if (kWgrad) fp8_segment_misaligned(t);
        if (!produce_tile<CF, false, false>(sm, ps, t, &map_a, &map_b, wb, &map_b_half, false, 0u, kFc1))
          break;  // a wait expired
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
      epilogue_fc1_fp8(acc, cwg, wt, t.out_row, t.b_n, static_cast<uint8_t*>(p.fc1_h), p.scale_h, p.n / 2);
    } else if constexpr (kWgrad) {
      if (fp8_segment_misaligned(t) && wt == 0 && cwg == 0 && p.error != nullptr)
        atomicCAS(p.error, 0u, kSiteFp8Segment);
      // Scales per 128 x 1 block: row block t.k_begin / 128 + kb of the output rows' and columns'.
      const int64_t kb0 = t.k_begin / 128;
      const TileScales sc{p.scale_a + kb0 * p.m_out + t.out_row, 1, p.scale_b + kb0 * p.n + t.b_n, p.n,
                          int32_t(n_blocks - t.b_n / 128), nullptr, p.m_out};
      mma_tile_scaled<CF, BScale::Column>(sm, ps, t, cwg, wt, acc, wb, sc, &skew);
      FormWgrad<CF>::epilogue(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
    } else {
      // The tile's rows' scales and its expert's scales for columns [b_n, b_n + 128).
      const TileScales sc{p.scale_a + int64_t(t.a_m) * kb, kb,
                          p.scale_b + (int64_t(t.b_batch) * n_blocks + t.b_n / 128) * kb, kb,
                          int32_t(n_blocks - t.b_n / 128)};
      mma_tile_scaled<CF, BScale::Block>(sm, ps, t, cwg, wt, acc, wb, sc, &skew);
      if constexpr (kMode == Fp8Mode::DgradSwiGLU)
        FormDgradSwiGLU<CF>::epilogue(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
      else
        epilogue_store<CF>(sm, es, cwg, wt, acc, &map_d0, t.out_row, t.b_n, p.n);
    }
  }
  epi_finish(wt == 0);
}

}  // namespace
}  // namespace engine

namespace {
template <int kBN, engine::Fp8Mode kMode>
void launch_fp8_cfg(const Plan& plan, cudaStream_t stream) {
  using CF = engine::Cfg<kBN, engine::OperandE4m3>;
  auto* kernel = &engine::fp8_grouped_kernel<CF, kMode>;
  static std::atomic<unsigned long long> configured{0};
  mok::detail::set_smem_once(kernel, int(CF::kSmemBytes), configured);
  kernel<<<unsigned(plan.grid), engine::kThreads, CF::kSmemBytes, stream>>>(plan.map_a, plan.map_b, plan.map_b_half,
                                                                           plan.map_d0, plan.map_d1, plan.params);
  MOK_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void detail::launch_fp8_grouped(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  using engine::Fp8Mode;
  if (plan.form == Form::Fp8Fc1)
    launch_fp8_cfg<256, Fp8Mode::Fc1>(plan, stream);
  else if (plan.form == Form::Fp8DgradSwiGLU)
    launch_fp8_cfg<256, Fp8Mode::DgradSwiGLU>(plan, stream);
  else if (plan.form == Form::Fp8Wgrad)
    launch_fp8_cfg<128, Fp8Mode::Wgrad>(plan, stream);  // (256: the column scales spill, plan_fp8_wgrad)
  else if (plan.block_n == 256)
    launch_fp8_cfg<256, Fp8Mode::Plain>(plan, stream);
  else
    launch_fp8_cfg<128, Fp8Mode::Plain>(plan, stream);
}

}  // namespace mok::gemm
