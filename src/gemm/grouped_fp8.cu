// mok — grouped GEMM with block-scaled FP8 operands (Form::Fp8Plain; gemm::plan_fp8_grouped): the
// persistent kernel of grouped_kernel.cuh's M-grouped schedule over Cfg<128 | 256, OperandE4m3>, whose
// consumers run the scaled mainloop (engine_fp8.cuh) and store the bf16 tile (engine_epilogue.cuh).
// One translation unit, like every form.
#include <atomic>

#include "common/cuda_check.h"
#include "gemm/engine_fp8.cuh"
#include "gemm/grouped_kernel.cuh"
#include "gemm/launchers.h"

namespace mok::gemm {
namespace engine {
namespace {

template <class CF>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_d0, const KernelParams p) {
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
      PipeState<CF> ps;
      MGroupedSchedule<CF> sched(p);
      while (sched.next(t, shared, dummy))
        if (!produce_tile<CF, false, false>(sm, ps, t, &map_a, &map_b, wb)) break;  // a wait expired
      drain_stages(sm, ps, wb);
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int cwg = int(threadIdx.x / 128u) - 1;
  const uint32_t wt = threadIdx.x % 128u;
  if (wt == 0 && cwg == 0) prefetch_tensor_map(&map_d0);
  PipeState<CF> ps;
  EpiState es;
  float acc[CF::kAccRegs];
  MGroupedSchedule<CF> sched(p);
  const int64_t kb = p.k_blocks, n_blocks = p.n / 128;
  while (sched.next(t, shared, dummy)) {
    // The tile's rows' scales and its expert's scales for columns [b_n, b_n + 128).
    const TileScales sc{p.scale_a + int64_t(t.a_m) * kb, kb,
                        p.scale_b + (int64_t(t.b_batch) * n_blocks + t.b_n / 128) * kb, kb,
                        int32_t(n_blocks - t.b_n / 128)};
    mma_tile_scaled<CF>(sm, ps, t, cwg, wt, acc, wb, sc);
    epilogue_store<CF>(sm, es, cwg, wt, acc, &map_d0, t.out_row, t.b_n, p.n);
  }
  epi_finish(wt == 0);
}

}  // namespace
}  // namespace engine

namespace {
template <int kBN>
void launch_fp8_cfg(const Plan& plan, cudaStream_t stream) {
  using CF = engine::Cfg<kBN, engine::OperandE4m3>;
  auto* kernel = &engine::fp8_grouped_kernel<CF>;
  static std::atomic<unsigned long long> configured{0};  // per device: the attribute is set
  int dev = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  const unsigned long long bit = 1ull << (dev & 63);
  if ((configured.load() & bit) == 0) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(CF::kSmemBytes)));
    configured.fetch_or(bit);
  }
  kernel<<<unsigned(plan.grid), engine::kThreads, CF::kSmemBytes, stream>>>(plan.map_a, plan.map_b, plan.map_d0,
                                                                           plan.params);
  MOK_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void detail::launch_fp8_grouped(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  if (plan.block_n == 256)
    launch_fp8_cfg<256>(plan, stream);
  else
    launch_fp8_cfg<128>(plan, stream);
}

}  // namespace mok::gemm
