// mok — grouped GEMM kernel, the weight gradient with gathered B rows (WgradArgs::gather_b): forms
// FormWgradGather and FormWgradAccumulateGather (256-wide tiles, no clusters; a translation unit of
// their own, so the other wgrad kernels build as before), and FormWgradGatherNoFence for the
// experiment MOK_EXP_GATHER_FENCE=0 (the consumers' proxy fence off; notes/memory.md).
#include "common/env_flag.h"
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

static_assert(engine::GatherOf<engine::FormWgradGather<engine::Cfg<256>>>::b &&
                  engine::GatherOf<engine::FormWgradGather<engine::Cfg<256>>>::fence &&
                  !engine::GatherOf<engine::FormWgradGatherNoFence<engine::Cfg<256>>>::fence &&
                  !engine::GatherOf<engine::FormWgrad<engine::Cfg<256>>>::b,
              "the gather forms are recognised as such (and the plain wgrad is not)");

void launch_wgrad_gather(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  static const bool fence = env_flag("MOK_EXP_GATHER_FENCE", true);  // (experiment)
  if (plan.params.wgrad_accumulate == 0 && !fence)
    launch_cfg<256, engine::FormWgradGatherNoFence, false>(plan, stream);
  else if (plan.params.wgrad_accumulate == 0)
    launch_cfg<256, engine::FormWgradGather, false>(plan, stream);
  else
    launch_cfg<256, engine::FormWgradAccumulateGather, false>(plan, stream);
}

}  // namespace mok::gemm::detail
