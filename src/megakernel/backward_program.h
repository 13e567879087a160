// mok — the backward's GEMM program (host interface): the four GEMMs of one backward window —
// FC2's dgrad fused with the SwiGLU backward (D2), FC1's dgrad (D1), dW_down (WD) and dW_gate /
// dW_up (W1) — as ONE persistent kernel on the megakernel runtime, instead of four kernels one
// after the other. Compute CTAs claim tickets (backward_plan.h, "the backward's GEMM program"),
// wait for the D2 tiles a tile depends on, and run the tile exactly as the unfused GEMM's kernel
// would (the same plans, forms and epilogues at BLOCK_N 256): the same bits. What it buys is the
// overlap: the short-K weight-gradient tiles (DRAM-bound by their bf16 output at few rows per
// expert) run beside FC1's compute-bound dgrad tiles, and no kernel waits for the last tiles of
// the one before it. The reverse-combine pull and the reverse-dispatch push stay in their own
// kernels around it (comm CTAs in this kernel are the next step, notes/backward.md).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "comm/device.cuh"
#include "mok/gemm.hpp"

namespace mok::mk {

// One GEMM of the program: the maps and kernel parameters of its unfused plan (gemm::plan_*).
struct BwdGemm {
  CUtensorMap a, b, b_half, d0, d1;
  gemm::KernelParams p;
};

struct BwdProgramParams {
  BwdGemm d2, d1, wd, w1;
  // bwd_program_counter_words(d2.p.num_m_tiles) words, zero at launch: the ticket, then per
  // routed M tile the reports of its D2 tiles (two per tile: one per consumer warpgroup).
  uint32_t* counters = nullptr;
  int32_t merge = 0;  // BwdGemmShape::merge (the layer's MOK_BWD_ORDER: phased, merged or static)
};

inline int64_t bwd_program_counter_words(int64_t m_tiles) { return 1 + m_tiles; }

// The program's GEMM from a plan: BLOCK_N 256 and no clusters (the program's tile shape), else
// mok::Error naming the plan.
BwdGemm bwd_gemm_of(const gemm::Plan& plan, const char* what);
// Launches the program on `grid` CTAs (one per SM; they need not all be resident: a CTA waits
// only for tiles of lower tickets, which CTAs already running hold). counters: zeroed by the
// caller on `stream` before.
void launch_backward_program(const BwdProgramParams& params, const comm::dev::DeviceComm& dc, int grid,
                             cudaStream_t stream);

}  // namespace mok::mk
