// mok — the forward megakernel for Config::precision MXFP8: the FP8 program (forward_kernel_fp8.cu)
// with FC1's epilogue writing h as MXFP8 re-blocked to 1 x 128 (engine_fp8.cuh, kMx); x and the
// weights reach it re-blocked by their quantizers (gemm::quantize_mxfp8_reblocked), so every other
// step is recipe 1's. Exported in mok::mk::mxfp8; one translation unit per variant.
#define MOK_FORWARD_FP8 1
#define MOK_FORWARD_MXFP8 1
#include "megakernel/forward_kernel.cu"
