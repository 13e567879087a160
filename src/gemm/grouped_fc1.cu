// mok — grouped GEMM kernel, form FormFc1 (one translation unit per kernel variant).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_fc1(const Plan& plan, cudaStream_t stream) { launch_form<engine::FormFc1>(plan, stream); }

}  // namespace mok::gemm::detail
