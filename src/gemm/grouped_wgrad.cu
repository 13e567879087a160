// mok — grouped GEMM kernel, forms FormWgrad and FormWgradOverlap (one translation unit per form).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_wgrad(const Plan& plan, cudaStream_t stream) {
  if (plan.overlap) {
    if (plan.grid > 0) launch_cfg<128, engine::FormWgradOverlap, false>(plan, stream);
    return;
  }
  launch_form<engine::FormWgrad>(plan, stream);
}

}  // namespace mok::gemm::detail
