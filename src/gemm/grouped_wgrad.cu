// mok — grouped GEMM kernel, forms FormWgrad and FormWgradAccumulate (one translation unit per form).
#include <cstdlib>
#include <string>

#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_wgrad(const Plan& plan, cudaStream_t stream) {
  if (plan.params.wgrad_accumulate == 0) {
    launch_form<engine::FormWgrad>(plan, stream);
  } else if (plan.grid > 0) {  // WgradArgs::accumulate (no clusters: plan_wgrad refuses them)
    // EXPERIMENT: MOK_WGRAD_ACC = tma (default) | red | rmw
    static const int mode = [] {
      const char* e = std::getenv("MOK_WGRAD_ACC");
      return e == nullptr ? 0 : std::string(e) == "red" ? 1 : std::string(e) == "rmw" ? 2 : 0;
    }();
    if (mode == 1) {
      if (plan.block_n == 128)
        launch_cfg<128, engine::FormWgradAccumulateRed, false>(plan, stream);
      else
        launch_cfg<256, engine::FormWgradAccumulateRed, false>(plan, stream);
    } else if (mode == 2) {
      if (plan.block_n == 128)
        launch_cfg<128, engine::FormWgradAccumulateRmw, false>(plan, stream);
      else
        launch_cfg<256, engine::FormWgradAccumulateRmw, false>(plan, stream);
    } else if (plan.block_n == 128)
      launch_cfg<128, engine::FormWgradAccumulate, false>(plan, stream);
    else
      launch_cfg<256, engine::FormWgradAccumulate, false>(plan, stream);
  }
}

}  // namespace mok::gemm::detail
