// mok — kernel parameters of the grouped GEMM kernels (shared by host and device code).
#pragma once

#include <cstdint>

namespace mok::gemm {

enum class Form : int {
  Fc1SwiGLU = 0,  // gu = x . W1p[e]^T (gate/up interleaved), h = silu(g) * u
  Plain = 1,      // out = a . W[e]^T, W [E, N, K] (FC2 forward)
  Dgrad = 2,      // out = a . W[e], W [E, K, N] (MN-major B)
  Wgrad = 3,      // dw[e] = a_e^T . b_e over expert e's rows (K-grouped, both operands MN-major)
  DgradSwiGLU = 4,  // FC2's dgrad fused with the SwiGLU backward: d_gu from dy . W_down[e] and gu
};

struct KernelParams {
  int32_t num_m_tiles = 0;  // M-grouped: 128-row tiles of the routed buffer; Wgrad: M tiles per expert
  int32_t n_tiles = 0;      // 256-column output tiles
  int32_t k_blocks = 0;     // M-grouped: 64-wide K blocks
  int32_t n = 0;            // output columns (FC1: 2*inter, the packed gate/up width)
  int32_t m_out = 0;        // Wgrad: output rows per expert
  int32_t experts = 0;      // Wgrad: experts
  int32_t group_m = 8;      // tile raster: M tiles per group (N outer, M inner inside a group)
  int32_t store_gu = 1;     // FC1: also store the gate/up pre-activations
  int32_t skew_stages = 0;  // stagger of the consumer warpgroups in K blocks (0: off, <= 4)
  const int32_t* tile_expert = nullptr;       // M-grouped: [num_m_tiles], -1 = skip the tile
  // Wgrad: [experts] first routed row and valid rows of each expert. FC1/FC2 (optional): with
  // them, a tile whose tokens fit in its first 64 rows runs in split-N form.
  const int32_t* expert_row_begin = nullptr;
  const int32_t* expert_rows = nullptr;
  void* fc1_h = nullptr;  // FC1: h, dense [rows, n/2] bf16 (split-N tiles at BLOCK_N 128 store to it directly)
  const void* gu = nullptr;  // DgradSwiGLU: the forward's packed gate/up pre-activations, dense [rows, 2n] bf16
  // Wgrad: the output rows are packed gate/up rows (m_out = 2I): map_d0 receives the gate rows and
  // map_d1 the up rows, each [experts, m_out / 2, n] in plain order (epilogue_store_gate_up).
  int32_t split_gate_up = 0;
  unsigned int* error = nullptr;              // bounded waits: error word (nullptr: unbounded)
  unsigned long long wait_limit_ns = 0;
};

}  // namespace mok::gemm
