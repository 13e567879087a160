// mok — grouped GEMM kernel, the weight gradient with gathered B rows (WgradArgs::gather_b): forms
// FormWgradGather and FormWgradAccumulateGather (256-wide tiles, no clusters; a translation unit of
// their own, so the other wgrad kernels build as before).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_wgrad_gather(const Plan& plan, cudaStream_t stream) {
  if (plan.grid == 0) return;
  if (plan.params.wgrad_accumulate == 0)
    launch_cfg<256, engine::FormWgradGather, false>(plan, stream);
  else
    launch_cfg<256, engine::FormWgradAccumulateGather, false>(plan, stream);
}

}  // namespace mok::gemm::detail
