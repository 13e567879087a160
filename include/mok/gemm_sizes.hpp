// mok — sizes of the grouped GEMM engine's buffers, without CUDA headers (the memory planner,
// src/megakernel/memory_plan.cpp, counts them in a library built without CUDA).
#pragma once

#include <cstdint>

namespace mok::gemm {

// Floats of a wgrad carry buffer (WgradArgs::carry) for an [m, n] gradient, at any tile width:
// whole 128-row tiles by whole 256-column tiles, one expert's worth.
constexpr int64_t wgrad_carry_floats(int64_t m, int64_t n) { return (m + 127) / 128 * 128 * ((n + 255) / 256 * 256); }

// Partial sums per row of DgradSwiGLUArgs::router_partial: one per 64 intermediate columns.
constexpr int64_t router_parts(int64_t inter) { return (inter + 63) / 64; }

// Shared memory of the engine's kernels per CTA (every form but the FP8 wgrad, whose stages also
// carry scales): the stages of A and B, 4 epilogue chunks of 8 KB, the barriers, 1 KB of
// alignment slack. engine::Cfg (src/gemm/engine_mainloop.cuh) asserts that this is its own sum.
constexpr int engine_smem_bytes(int block_n) {
  const int stages = block_n == 128 ? 6 : 4;
  return stages * (16384 + block_n * 128) + 4 * 8192 + (2 * stages + 2) * 8 + 1024;
}

}  // namespace mok::gemm
