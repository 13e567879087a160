// mok — token movement of the unfused path (and the reference loops of the megakernel's comm
// CTAs): pull dispatch and push combine driven by the receiver-side schedule.
//   pull:  x_routed[i] = x[src_rank[i]][src_slot[i] / k]   (padding rows: zero)
//   push:  combine[src_rank[i]][src_slot[i]] = y_routed[i]  (valid rows only)
// `peers` arguments are device arrays of W pointers (peer addresses over NVLink for other
// ranks). Row counts come from the schedule's device-side totals: no host synchronization.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "schedule/schedule_gpu.h"

namespace mok::gpu {

struct MoveArgs {
  ScheduleView schedule;
  int64_t hidden = 0;     // H, multiple of 8
  int64_t top_k = 0;
  int64_t row_begin = 0;  // first routed row of the window (ring / macrobatch); rows are
  int64_t row_end = -1;   // clipped to [row_begin, min(row_end, total_rows)); -1 = to the end
  int sms = 16;           // CTAs used (one per SM)
  const uint32_t* abort = nullptr;  // the communicator's abort word: no row moves once it is set
};

// Throws mok::Error naming the first bad field (H a positive multiple of 8, k >= 1, sms >= 1, a
// valid row window); every movement kernel's launcher calls it.
void check_move_args(const MoveArgs& a);
// x_peers[r]: rank r's x [T_r, H] bf16. x_routed: [rows of the window, H] bf16 (window-relative).
void pull_dispatch(const MoveArgs& a, const void* const* x_peers, void* x_routed, cudaStream_t stream);
// Config::precision FP8: x_peers[r] holds rank r's x as E4M3 codes [T_r, H] and, `scale_offset`
// bytes on (the same in every rank's window), its 1 x 128 scales [T_r, H / 128] fp32; the routed
// rows go to codes_routed [rows, H] and scales_routed [rows, H / 128] (padding rows: zero codes,
// scale 0). H must be a multiple of 128.
void pull_dispatch_fp8(const MoveArgs& a, const void* const* x_peers, int64_t scale_offset, void* codes_routed,
                       float* scales_routed, cudaStream_t stream);
// The general FP8 row pull behind it (and behind the FP8 backward's reverse combine at EP 1,
// layer_fp8_backward.cu):
// a row's codes `code_offset` bytes into its owner's window, its scales `scale_offset` bytes in
// (both multiples of 16, the same in every rank's window), padding rows given zero codes and
// `pad_scale`; with weight_peers (rank r's router weights [T_r, k] f32) also row_weight[row] =
// the row's weight (0 for padding rows).
struct Fp8RowsAt {
  int64_t code_offset = 0, scale_offset = 0;
  float pad_scale = 0.0f;
};
void pull_fp8_rows(const MoveArgs& a, const void* const* peers, const Fp8RowsAt& at, void* codes_routed,
                   float* scales_routed, cudaStream_t stream, const float* const* weight_peers = nullptr,
                   float* row_weight = nullptr);
// y_routed: [rows of the window, H] bf16 (window-relative). combine_peers[r]: [T_r * k, H] bf16.
void push_combine(const MoveArgs& a, const void* y_routed, void* const* combine_peers, cudaStream_t stream);

}  // namespace mok::gpu
