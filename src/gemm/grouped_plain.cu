// mok — grouped GEMM kernel, form FormPlain (one translation unit per kernel variant).
#include "gemm/launch.cuh"

namespace mok::gemm::detail {

void launch_plain(const Plan& plan, cudaStream_t stream) { launch_form<engine::FormPlain>(plan, stream); }

}  // namespace mok::gemm::detail
