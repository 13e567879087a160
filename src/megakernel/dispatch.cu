#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "megakernel/dispatch.h"
#include "megakernel/move_row.cuh"
#include "mok/errors.hpp"

namespace mok::gpu {

namespace {

constexpr int kThreads = 512;

// Warps of all CTAs stride over the window's rows; `kPull` selects the direction.
template <bool kPull>
__global__ void __launch_bounds__(kThreads) move_rows_kernel(ScheduleView s, int hidden_vecs, int top_k,
                                                             int64_t row_begin, int64_t row_end,
                                                             const uint4* const* src_peers,
                                                             const uint4* local_src, uint4* local_dst,
                                                             uint4* const* dst_peers, const uint32_t* abort) {
  for_each_window_row(s, row_begin, row_end, abort, [&](int64_t row, int lane) {
    const int src = s.src_rank[row];
    const int slot = s.src_slot[row];
    const int64_t local = (row - row_begin) * hidden_vecs;
    if constexpr (kPull) {
      if (src >= 0) {
        copy_row(src_peers[src] + static_cast<int64_t>(slot / top_k) * hidden_vecs, local_dst + local,
                 hidden_vecs, lane);
      } else {
        zero_row(local_dst + local, hidden_vecs, lane);
      }
    } else if (src >= 0) {
      copy_row(local_src + local, dst_peers[src] + static_cast<int64_t>(slot) * hidden_vecs,
               hidden_vecs, lane);
    }
  });
}

// FP8 pull: a row's H code bytes (H / 16 vectors, code_offset bytes into the peer's window) and
// its H / 128 scales (scale_offset bytes in); padding rows get zero codes and pad_scale. With
// weight_peers, also the row's router weight into row_weight (0 for padding rows).
__global__ void __launch_bounds__(kThreads) pull_fp8_kernel(ScheduleView s, int code_vecs, int scales, int top_k,
                                                            int64_t row_begin, int64_t row_end,
                                                            const uint8_t* const* src_peers, int64_t code_offset,
                                                            int64_t scale_offset, float pad_scale, uint4* codes,
                                                            float* scale_out, const float* const* weight_peers,
                                                            float* row_weight, const uint32_t* abort) {
  for_each_window_row(s, row_begin, row_end, abort, [&](int64_t row, int lane) {
    const int src = s.src_rank[row];
    const int64_t local = row - row_begin;
    float* to_scales = scale_out + local * scales;
    if (src >= 0) {
      const int slot = s.src_slot[row];
      const int64_t token = slot / top_k;
      const uint8_t* peer = src_peers[src];
      copy_row(reinterpret_cast<const uint4*>(peer + code_offset) + token * code_vecs, codes + local * code_vecs,
               code_vecs, lane);
      const float* from_scales = reinterpret_cast<const float*>(peer + scale_offset) + token * scales;
      for (int i = lane; i < scales; i += 32) to_scales[i] = from_scales[i];
      if (weight_peers != nullptr && lane == 0) row_weight[local] = weight_peers[src][slot];
    } else {
      zero_row(codes + local * code_vecs, code_vecs, lane);
      for (int i = lane; i < scales; i += 32) to_scales[i] = pad_scale;
      if (weight_peers != nullptr && lane == 0) row_weight[local] = 0.0f;
    }
  });
}

}  // namespace

void check_move_args(const MoveArgs& a) {
  MOK_REQUIRE(a.hidden > 0 && a.hidden % 8 == 0, "hidden", "must be a positive multiple of 8, got ", a.hidden);
  MOK_REQUIRE(a.top_k >= 1, "top_k", "must be >= 1, got ", a.top_k);
  MOK_REQUIRE(a.sms >= 1, "sms", "must be >= 1, got ", a.sms);
  MOK_REQUIRE(a.row_begin >= 0 && (a.row_end < 0 || a.row_end >= a.row_begin), "row_begin/row_end",
              "need 0 <= row_begin <= row_end (or row_end = -1), got ", a.row_begin, ", ", a.row_end);
}

void pull_dispatch(const MoveArgs& a, const void* const* x_peers, void* x_routed, cudaStream_t stream) {
  check_move_args(a);
  move_rows_kernel<true><<<a.sms, kThreads, 0, stream>>>(
      a.schedule, static_cast<int>(a.hidden / 8), static_cast<int>(a.top_k), a.row_begin, a.row_end,
      reinterpret_cast<const uint4* const*>(x_peers), nullptr, static_cast<uint4*>(x_routed), nullptr, a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void pull_fp8_rows(const MoveArgs& a, const void* const* peers, const Fp8RowsAt& at, void* codes_routed,
                   float* scales_routed, cudaStream_t stream, const float* const* weight_peers, float* row_weight) {
  check_move_args(a);
  MOK_REQUIRE(a.hidden % 128 == 0, "hidden", "must be a multiple of 128 with FP8 rows (1 x 128 scales), got ",
              a.hidden);
  MOK_REQUIRE(at.code_offset >= 0 && at.code_offset % 16 == 0, "code_offset",
              "must be a non-negative multiple of 16, got ", at.code_offset);
  MOK_REQUIRE(at.scale_offset >= 0 && at.scale_offset % 16 == 0, "scale_offset",
              "must be a non-negative multiple of 16, got ", at.scale_offset);
  MOK_REQUIRE((weight_peers == nullptr) == (row_weight == nullptr), "row_weight",
              "weight_peers and row_weight must be given together (or neither)");
  pull_fp8_kernel<<<a.sms, kThreads, 0, stream>>>(
      a.schedule, static_cast<int>(a.hidden / 16), static_cast<int>(a.hidden / 128), static_cast<int>(a.top_k),
      a.row_begin, a.row_end, reinterpret_cast<const uint8_t* const*>(peers), at.code_offset, at.scale_offset,
      at.pad_scale, static_cast<uint4*>(codes_routed), scales_routed, weight_peers, row_weight, a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void pull_dispatch_fp8(const MoveArgs& a, const void* const* x_peers, int64_t scale_offset, void* codes_routed,
                       float* scales_routed, cudaStream_t stream) {
  pull_fp8_rows(a, x_peers, Fp8RowsAt{0, scale_offset, 0.0f}, codes_routed, scales_routed, stream);
}

void push_combine(const MoveArgs& a, const void* y_routed, void* const* combine_peers, cudaStream_t stream) {
  check_move_args(a);
  move_rows_kernel<false><<<a.sms, kThreads, 0, stream>>>(
      a.schedule, static_cast<int>(a.hidden / 8), static_cast<int>(a.top_k), a.row_begin, a.row_end,
      nullptr, static_cast<const uint4*>(y_routed), nullptr, reinterpret_cast<uint4* const*>(combine_peers), a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gpu
