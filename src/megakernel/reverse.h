// mok — the backward's token movement and the router-weight gradient (the unfused backward, and
// the reference loops a backward megakernel's comm CTAs will mirror), driven by the same
// receiver-side schedule as the forward:
//   reverse combine (pull):  dy_routed[i] = d_out[src][slot / k], row_weight[i] = w[src][slot]
//                            (unweighted rows; padding rows: 0), or rnd(w * d_out) rows
//   router-weight gradient:  d_topk_w[t, j] = sum of FC2 dgrad's partial sums <rnd(d_out . W_down), h>
//                            of the row of slot t*k + j (gemm::DgradSwiGLUArgs::router_partial),
//                            pushed into the source rank's gradient window, then copied out there
//                            (0 for empty slots)
// The reverse dispatch (each routed row's d_x pushed to its source slot) is push_combine's copy
// (dispatch.h) with the d_x rows in place of y; the backward runs it inside push_router_grad (one
// kernel for both pushes). Rounding points: include/mok/reference.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megakernel/dispatch.h"
#include "schedule/schedule_math.h"

namespace mok::gpu {

// d_out_peers[r]: rank r's d_out [T_r, H] bf16; weight_peers[r]: rank r's router weights [T_r, k]
// f32 (peer addresses for r != this rank). dy_routed: [rows of the window, H] bf16.
// row_weight (optional, [rows of the window] f32): the rows are copied unweighted and their
// router weights written there; without it the rows are weighted, rnd(w * d_out). x_peers /
// x_rows (optional, together): the rows' x rows pulled in the same kernel, as pull_dispatch does
// (the backward over windows: one kernel for the window's two pulls).
void pull_reverse_combine(const MoveArgs& a, const void* const* d_out_peers, const float* const* weight_peers,
                          void* dy_routed, cudaStream_t stream, float* row_weight = nullptr,
                          const void* const* x_peers = nullptr, void* x_rows = nullptr);

// The router-weight gradient of the window's routed rows: partial [rows of the window, parts] f32
// (FC2 dgrad's router_partial) summed in increasing order per row into slot src_slot of rank
// src_rank's window (d_weight_peers[r]: rank r's [T_r, k] f32). y_routed / combine_peers
// (optional, together): the rows' d_x rows pushed into their source slots in the same kernel, as
// push_combine does (the backward's two pushes in one kernel).
void push_router_grad(const MoveArgs& a, const float* partial, int64_t parts, float* const* d_weight_peers,
                      cudaStream_t stream, const void* y_routed = nullptr, void* const* combine_peers = nullptr);

// d_topk_w [slots] = this rank's gradient window (every push into it landed), 0 for the empty
// slots of topk_idx (the published routing), NaN everywhere once `abort` is set.
void finish_router_grad(const float* window, const int32_t* topk_idx, int64_t slots, const uint32_t* abort,
                        float* d_topk_w, cudaStream_t stream);

// A collective call compared across ranks (the backward's forward number and the layer's):
// publish_call_id writes both into this rank's call words (two int64, before the call's first
// barrier), check_call_ids reads every peer's (after it) and reports
// DeviceErrorCode::ForwardIdDiffers into error_word for a peer that differs (nothing once `abort`
// is set).
void publish_call_id(void* words, int64_t id, int64_t layer, cudaStream_t stream);
void check_call_ids(const void* const* peers, int world, int64_t id, int64_t layer, int rank,
                    unsigned long long* error_word, const uint32_t* abort, cudaStream_t stream);

// The backward over windows of the routed layout (notes/memory.md), for window [lo, hi) (whole
// 128-row tiles) of `v`'s rows: parts[e] = expert e's first token row in the window, relative to
// lo, parts[experts + e] its token rows there (0: none; the expert held in from the previous
// window starts -held rows early, its rows counting them), then at parts + 2 * experts
// schedule_math.h's WindowEnds: [0] / [1] the expert whose token rows cross lo / hi with their
// weight-gradient sums carried in / out (-1 = none), [2] / [3] {first, count} of the experts the
// window owns (its wgrads' WgradArgs::expert_range; `last`: the last window, hi = the layout's
// end), [4] / [5] / [6] the expert held over to the next window (-1 = none), its rows and their
// first row (window-relative). `hold`: rows = 0 never holds.
// parts: 2 * experts + sched::kWindowEndWords int32 (device).
void window_parts(const ScheduleView& v, int64_t experts, int64_t lo, int64_t hi, bool last, int32_t* parts,
                  cudaStream_t stream, const sched::WindowHold& hold = {});

// The held rows: the held-over expert's rows of up to kMax operands (from[i], window-relative rows
// of row_bytes[i]) copied to the last rows of hold buffers (to[i], hold_rows rows each), where the
// next window's weight gradients read them (WgradArgs::hold_*). parts: window_parts' output.
struct HoldCopy {
  static constexpr int kMax = 4;
  const void* from[kMax] = {};
  void* to[kMax] = {};
  int64_t row_bytes[kMax] = {};
  int count = 0;
  int64_t hold_rows = 0;
};
void hold_rows(const int32_t* parts, int64_t experts, const HoldCopy& c, int sms, cudaStream_t stream);

}  // namespace mok::gpu
