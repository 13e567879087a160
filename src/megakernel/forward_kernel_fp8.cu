// mok — the forward megakernel on block-scaled FP8 operands (Config::precision FP8): the forward
// program of forward_kernel.cu compiled with Cfg<256, OperandE4m3> (forward_common.cuh), its
// exported functions in mok::mk::fp8. One translation unit per variant keeps each build light.
#define MOK_FORWARD_FP8 1
#include "megakernel/forward_kernel.cu"
