// mok — grouped GEMM kernel, forms FormWgrad and FormWgradAccumulate (one translation unit per form).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_wgrad(const Plan& plan, cudaStream_t stream) {
  if (plan.params.wgrad_accumulate == 0) {
    launch_form<engine::FormWgrad>(plan, stream);
  } else if (plan.grid > 0) {  // WgradArgs::accumulate (no clusters: plan_wgrad refuses them)
    if (plan.block_n == 128)
      launch_cfg<128, engine::FormWgradAccumulate, false>(plan, stream);
    else
      launch_cfg<256, engine::FormWgradAccumulate, false>(plan, stream);
  }
}

}  // namespace mok::gemm::detail
