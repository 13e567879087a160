// mok — the per-form kernel launchers behind gemm::run() (one per .cu, see launch.cuh).
// Internal: declared here, not in the public mok/gemm.hpp, so that header names only the API.
#pragma once

#include <cuda_runtime.h>

#include "mok/gemm.hpp"

namespace mok::gemm::detail {
void launch_fc1(const Plan& plan, cudaStream_t stream);
void launch_plain(const Plan& plan, cudaStream_t stream);
void launch_dgrad(const Plan& plan, cudaStream_t stream);
void launch_dgrad_scatter(const Plan& plan, cudaStream_t stream);
void launch_dgrad_swiglu(const Plan& plan, cudaStream_t stream);
void launch_wgrad(const Plan& plan, cudaStream_t stream);
void launch_fp8_grouped(const Plan& plan, cudaStream_t stream);
}  // namespace mok::gemm::detail
