// mok — grouped GEMM kernel, form FormDgrad (one translation unit per kernel variant).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_dgrad(const Plan& plan, cudaStream_t stream) { launch_form<engine::FormDgrad>(plan, stream); }

}  // namespace mok::gemm::detail
