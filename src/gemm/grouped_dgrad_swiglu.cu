// mok — grouped GEMM kernel, form FormDgradSwiGLU (one translation unit per kernel variant).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_dgrad_swiglu(const Plan& plan, cudaStream_t stream) {
  launch_form<engine::FormDgradSwiGLU2>(plan, stream);  // (two gate/up chunks in flight)
}

}  // namespace mok::gemm::detail
