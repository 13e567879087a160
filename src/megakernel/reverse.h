// mok — the backward's token movement and the router-weight gradient (the unfused backward, and
// the reference loops a backward megakernel's comm CTAs will mirror), driven by the same
// receiver-side schedule as the forward:
//   reverse combine (pull):  dy_routed[i] = rnd(w[src][slot] * d_out[src][slot / k])   (padding rows: 0)
//   router-weight gradient:  d_topk_w[t, j] = sum_h d_out[t, h] * y[t*k + j, h]          (on the source rank;
//                            y = the row the forward pushed into combine slot t*k + j; 0 for empty slots)
// The reverse dispatch (each routed row's d_x pushed to its source slot) is push_combine
// (dispatch.h) with the d_x rows in place of y. Rounding points: include/mok/reference.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megakernel/dispatch.h"

namespace mok::gpu {

// d_out_peers[r]: rank r's d_out [T_r, H] bf16; weight_peers[r]: rank r's router weights [T_r, k]
// f32 (peer addresses for r != this rank). dy_routed: [rows of the window, H] bf16.
void pull_reverse_combine(const MoveArgs& a, const void* const* d_out_peers, const float* const* weight_peers,
                          void* dy_routed, cudaStream_t stream);

// The backward over windows of the routed layout (notes/memory.md), for window [lo, hi) (whole
// 128-row tiles) of `v`'s rows: parts[e] = expert e's first token row in the window, relative to
// lo, parts[experts + e] its token rows there (0: none), parts[2 * experts] / parts[2 * experts + 1]
// the expert whose token rows cross lo / hi (its weight-gradient sums carry in / out; -1 = none).
// parts: 2 * experts + 2 int32 (device). schedule_math.h's window_part / rows_cross.
void window_parts(const ScheduleView& v, int64_t experts, int64_t lo, int64_t hi, int32_t* parts,
                  cudaStream_t stream);

// h = rnd(silu(g) * u) of the saved gate/up rows gu [tiles * 128, 2I] (packed order, mok/gemm.hpp)
// into h [tiles * 128, I], bf16, the rows of tiles whose tile_expert entry (device) is -1 left
// alone: the bits of FC1's epilogue for the same rows (gemm/swiglu_math.cuh), so a backward that
// reads saved pre-activations computes the h of one that recomputes FC1.
void swiglu_rows(const void* gu, void* h, int64_t inter, const int32_t* tile_expert, int64_t tiles,
                 cudaStream_t stream);

struct RouterGradArgs {
  const void* d_out = nullptr;     // [T, H] bf16
  const void* y_slots = nullptr;   // [T*k, H] bf16: the forward's combine slots
  const int32_t* topk_idx = nullptr;  // [T, k]: the forward's published (checked) routing, -1 = empty slot
  const uint32_t* abort = nullptr;    // the communicator's abort word: all NaN once it is set
  int64_t tokens = 0, top_k = 0, hidden = 0;  // H a multiple of 8
  float* d_topk_w = nullptr;       // [T, k]
};
// fp32 products summed per lane in increasing h, then the 32 lane sums in a fixed tree: the same
// bits on every run (the reference sums strictly left to right, so the two agree to rounding).
void router_weight_grad(const RouterGradArgs& a, cudaStream_t stream);

}  // namespace mok::gpu
