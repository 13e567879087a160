// mok — grouped GEMM kernel, form FormWgrad (one translation unit per kernel variant).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_wgrad(const Plan& plan, cudaStream_t stream) { launch_form<engine::FormWgrad>(plan, stream); }

}  // namespace mok::gemm::detail
