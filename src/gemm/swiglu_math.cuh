// mok — SwiGLU of one gate/up pair whose values are already bf16 (as fp32): silu(g) * u in fp32,
// silu(g) = g / (1 + exp(-g)) with the SFU approximations (__expf: ex2.approx, __fdividef:
// rcp.approx). One definition for FC1's epilogue (engine_epilogue.cuh's swiglu, which rounds the
// accumulators to bf16 first) and for the backward's h from the gate/up rows (FC2's dgrad
// epilogue, epilogue_dgrad_swiglu): the two give the same bits, so the backward needs no h from
// the forward, and one that reads saved pre-activations and one that recomputes FC1 agree exactly.
// For g < -87 exp overflows: silu -> -0.
#pragma once

namespace mok::gemm {

__device__ __forceinline__ float swiglu_of_bf16(float g, float u) {
  const float silu = __fdividef(g, 1.0f + __expf(-g));
  return silu * u;
}

}  // namespace mok::gemm
