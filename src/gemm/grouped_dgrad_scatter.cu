// mok — grouped GEMM kernel, form FormDgradScatter (one translation unit per kernel variant): FC1's
// dgrad with the reverse dispatch in its epilogue (plan_dgrad_scatter).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_dgrad_scatter(const Plan& plan, cudaStream_t stream) {
  launch_form<engine::FormDgradScatter>(plan, stream);
}

}  // namespace mok::gemm::detail
