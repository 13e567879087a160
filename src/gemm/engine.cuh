// mok — the SM90 BF16 tile engine: engine_mainloop.cuh (configuration, shared memory, producer,
// consumers' mainloop) and engine_epilogue.cuh (the epilogues). Include this one.
#pragma once

#include "gemm/engine_epilogue.cuh"
#include "gemm/engine_mainloop.cuh"
