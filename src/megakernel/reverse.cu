#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "common/error_word.h"
#include "megakernel/move_row.cuh"
#include "megakernel/reverse.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "schedule/schedule_math.h"

namespace mok::gpu {

namespace {

constexpr int kThreads = 512;

union Pack8 {
  uint4 raw;
  __nv_bfloat162 h2[4];
};

// rnd(w * v) for 8 bf16 values: one fp32 product each, rounded once to bf16 (no FMA to contract).
__device__ __forceinline__ uint4 scale_row_vec(uint4 raw, float w) {
  Pack8 in, out;
  in.raw = raw;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(in.h2[q]);
    out.h2[q] = __floats2bfloat162_rn(__fmul_rn(w, f.x), __fmul_rn(w, f.y));
  }
  return out.raw;
}

// rnd(w * v) for a row of 8-value vectors, four loads in flight per lane.
__device__ __forceinline__ void scale_row(const uint4* from, uint4* to, int hidden_vecs, int lane, float w) {
  int v = lane;
  for (; v + 96 < hidden_vecs; v += 128) {
    const uint4 a = from[v], b = from[v + 32], c = from[v + 64], d = from[v + 96];
    to[v] = scale_row_vec(a, w);
    to[v + 32] = scale_row_vec(b, w);
    to[v + 64] = scale_row_vec(c, w);
    to[v + 96] = scale_row_vec(d, w);
  }
  for (; v < hidden_vecs; v += 32) to[v] = scale_row_vec(from[v], w);
}

// One warp per routed row (warps of all CTAs stride over the window's rows), four 16-byte loads in
// flight per lane: the rows come over NVLink from the source rank. With row_weight the rows are
// copied unweighted and their weights written there (0 for padding rows). With x_peers the row's x
// row is pulled too, into x_rows (zero for padding rows; the pull dispatch's copy): a window's two
// pulls in one kernel.
__global__ void __launch_bounds__(kThreads) reverse_combine_kernel(ScheduleView s, int hidden_vecs, int top_k,
                                                                   int64_t row_begin, int64_t row_end,
                                                                   const uint4* const* d_out_peers,
                                                                   const float* const* weight_peers,
                                                                   uint4* __restrict__ dy, float* row_weight,
                                                                   const uint4* const* x_peers, uint4* x_rows,
                                                                   const uint32_t* abort) {
  for_each_window_row(s, row_begin, row_end, abort, [&](int64_t row, int lane) {
    const int src = s.src_rank[row];
    const int64_t local = (row - row_begin) * hidden_vecs;
    uint4* to = dy + local;
    if (src < 0) {
      zero_row(to, hidden_vecs, lane);
      if (row_weight != nullptr && lane == 0) row_weight[row - row_begin] = 0.0f;
      if (x_peers != nullptr) zero_row(x_rows + local, hidden_vecs, lane);
      return;
    }
    const int slot = s.src_slot[row];
    const float w = weight_peers[src][slot];
    const int64_t token = static_cast<int64_t>(slot / top_k) * hidden_vecs;
    if (x_peers != nullptr) copy_row(x_peers[src] + token, x_rows + local, hidden_vecs, lane);
    const uint4* from = d_out_peers[src] + token;
    if (row_weight == nullptr) {
      scale_row(from, to, hidden_vecs, lane, w);
      return;
    }
    if (lane == 0) row_weight[row - row_begin] = w;
    copy_row(from, to, hidden_vecs, lane);
  });
}

// One warp per routed row: the row's partial sums, 32 loads at a time (one per lane), added in
// increasing order through shuffles (no serial chain of loads), into its source slot of the
// source rank's gradient window. With combine_peers the row's d_x row (y_rows) goes to that slot of
// the source rank's combine window too (the reverse dispatch: push_combine's copy): a window's two
// pushes in one kernel.
__global__ void __launch_bounds__(kThreads) router_grad_push_kernel(ScheduleView s, int64_t row_begin,
                                                                    int64_t row_end, const float* __restrict__ part,
                                                                    int parts, float* const* d_weight_peers,
                                                                    const uint4* y_rows, uint4* const* combine_peers,
                                                                    int hidden_vecs, const uint32_t* abort) {
  for_each_window_row(s, row_begin, row_end, abort, [&](int64_t row, int lane) {
    const int src = s.src_rank[row];
    if (src < 0) return;  // uniform over the warp
    const int slot = s.src_slot[row];
    const float* p = part + (row - row_begin) * parts;
    float sum = 0.0f;
    for (int base = 0; base < parts; base += 32) {
      const float v = base + lane < parts ? p[base + lane] : 0.0f;
      const int n = parts - base < 32 ? parts - base : 32;
      for (int i = 0; i < n; ++i) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, i));
    }
    if (lane == 0) d_weight_peers[src][slot] = sum;
    if (combine_peers != nullptr)
      copy_row(y_rows + (row - row_begin) * hidden_vecs, combine_peers[src] + static_cast<int64_t>(slot) * hidden_vecs,
               hidden_vecs, lane);
  });
}

// The gradient window's slots into d_topk_w: 0 for empty slots, NaN everywhere after a failure
// (abort set: slots may hold sums nobody finished), never a plausible wrong value.
__global__ void router_grad_finish_kernel(const float* __restrict__ win, const int32_t* __restrict__ topk_idx,
                                          int64_t slots, const uint32_t* abort, float* __restrict__ out) {
  const bool aborted = abort_seen(abort);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < slots; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = aborted ? __int_as_float(0x7fc00000) : (topk_idx[i] < 0 ? 0.0f : win[i]);
}

// The backward's forward id: written into this rank's call word before the first barrier, and
// after it compared with every peer's (a mismatch is reported, not trapped: check() names it).
__global__ void publish_call_kernel(int64_t* words, int64_t id, int64_t layer) {
  words[0] = id;
  words[1] = layer;
}

__global__ void check_calls_kernel(const int64_t* const* peers, int world, int64_t id, int64_t layer, int rank,
                                   unsigned long long* error_word, const uint32_t* abort) {
  if (abort_seen(abort)) return;  // a peer that failed may never have written its words
  for (int r = int(threadIdx.x); r < world; r += int(blockDim.x)) {
    const volatile int64_t* w = peers[r];
    const int64_t theirs = w[0], their_layer = w[1];
    if (theirs != id || their_layer != layer)
      report_device_error(error_word, DeviceErrorCode::ForwardIdDiffers, rank,
                          (uint64_t(r) << 40) | (uint64_t(theirs) & 0xffffffffffull));
  }
}

// One block: every expert's part of window [lo, hi) and what the window exchanges with its
// neighbours (schedule_math.h's window_ends: the carried experts, the owned range, the held rows;
// the expert held in starts its K held_in_rows rows early). Each thread tests its experts (the
// last crossing lo / hi, the first and last owned: shared-memory atomics, so the same experts as
// the ordered walk), thread 0 derives the rest (window_ends_of). Thread 0 walking all experts took
// 28 us per window at 256 experts (one L2 round trip per expert; ncu, one H100,
// bench/results/backward-kernels-ncu-h100x1.json), still 22 us from shared memory; this block-
// parallel search 3.2 us (ncu, one H100: 12 windows of a DeepSeek-V3 EP 1 backward in 38 us).
__global__ void window_parts_kernel(const int32_t* expert_offset, const int32_t* expert_rows, int32_t experts,
                                    int64_t lo, int64_t hi, bool last, sched::WindowHold hold, int32_t* parts) {
  __shared__ int32_t found[4];  // cross lo, cross hi, first owned, last owned
  if (threadIdx.x < 4) found[threadIdx.x] = threadIdx.x == 2 ? INT32_MAX : -1;
  __syncthreads();
  for (int32_t e = int32_t(threadIdx.x); e < experts; e += int32_t(blockDim.x)) {
    const int32_t b = expert_offset[e], r = expert_rows[e];
    const sched::WindowPart p = sched::window_part(b, r, lo, hi);
    parts[e] = p.begin;
    parts[experts + e] = p.rows;
    if (sched::rows_cross(b, r, lo)) atomicMax(&found[0], e);
    if (sched::rows_cross(b, r, hi)) atomicMax(&found[1], e);
    if (sched::window_owns(b, r, lo, hi, last)) {
      atomicMin(&found[2], e);
      atomicMax(&found[3], e);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const sched::WindowEnds w = sched::window_ends_of(expert_offset, expert_rows, found[0], found[1],
                                                      found[3] < 0 ? -1 : found[2], found[3], lo, hi, hold);
    if (w.held_in >= 0) {
      parts[w.held_in] -= w.held_in_rows;  // (its part starts at 0)
      parts[experts + w.held_in] += w.held_in_rows;
    }
    int32_t* t = parts + 2 * experts;
    t[0] = w.carry_in;
    t[1] = w.carry_out;
    t[2] = w.first;
    t[3] = w.owned;
    t[4] = w.held_out;
    t[5] = w.held_out_rows;
    t[6] = w.held_out_at;
  }
}

// The held-over expert's rows of each operand (window-relative, from parts' held-out record) to
// the end of its hold buffer: rows [held_out_at, + n) -> [hold_rows - n, hold_rows). Nothing when
// the window holds nothing. Grid-stride over 16-byte vectors.
__global__ void __launch_bounds__(kThreads) hold_rows_kernel(const int32_t* ends, HoldCopy c) {
  if (ends[4] < 0) return;
  const int64_t n = ends[5], at = ends[6];
#pragma unroll
  for (int i = 0; i < HoldCopy::kMax; ++i) {  // (unrolled: the struct's arrays stay in the parameter space)
    if (i >= c.count) break;
    const int64_t vecs = c.row_bytes[i] / 16, total = n * vecs;
    const uint4* from = reinterpret_cast<const uint4*>(c.from[i]) + at * vecs;
    uint4* to = reinterpret_cast<uint4*>(c.to[i]) + (c.hold_rows - n) * vecs;
    for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += int64_t(gridDim.x) * blockDim.x)
      to[v] = from[v];
  }
}

}  // namespace

void window_parts(const ScheduleView& v, int64_t experts, int64_t lo, int64_t hi, bool last, int32_t* parts,
                  cudaStream_t stream, const sched::WindowHold& hold) {
  MOK_REQUIRE(experts >= 1 && experts < (int64_t(1) << 24), "window_parts.experts", "in [1, 2^24), got ", experts);
  MOK_REQUIRE(lo >= 0 && hi > lo && lo % sched::kBlockM == 0 && hi % sched::kBlockM == 0, "window_parts.lo/hi",
              "a window of whole ", sched::kBlockM, "-row tiles, got [", lo, ", ", hi, ")");
  MOK_REQUIRE(hold.rows >= 0 && hold.rows % sched::kBlockM == 0 && hold.prev_lo >= 0 && hold.prev_lo <= lo,
              "window_parts.hold", "whole tiles of rows, and the previous window's first row at most lo, got ",
              hold.rows, " rows, previous window at ", hold.prev_lo);
  window_parts_kernel<<<1, 256, 0, stream>>>(v.expert_offset, v.expert_rows, int32_t(experts), lo, hi, last, hold,
                                             parts);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void hold_rows(const int32_t* parts, int64_t experts, const HoldCopy& c, int sms, cudaStream_t stream) {
  MOK_REQUIRE(c.count >= 1 && c.count <= HoldCopy::kMax && c.hold_rows > 0, "hold_rows",
              "1 to ", HoldCopy::kMax, " operands and a hold of rows, got ", c.count, " and ", c.hold_rows);
  for (int i = 0; i < c.count; ++i)
    MOK_REQUIRE(c.from[i] && c.to[i] && c.row_bytes[i] > 0 && c.row_bytes[i] % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(c.from[i]) % 16 == 0 && reinterpret_cast<uintptr_t>(c.to[i]) % 16 == 0,
                "hold_rows", "operand ", i, ": 16-byte aligned rows of whole 16-byte vectors");
  hold_rows_kernel<<<std::max(1, sms), kThreads, 0, stream>>>(parts + 2 * experts, c);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void pull_reverse_combine(const MoveArgs& a, const void* const* d_out_peers, const float* const* weight_peers,
                          void* dy_routed, cudaStream_t stream, float* row_weight, const void* const* x_peers,
                          void* x_rows) {
  check_move_args(a);
  MOK_REQUIRE(d_out_peers && weight_peers && dy_routed, "pull_reverse_combine",
              "d_out_peers, weight_peers and dy_routed must be non-null");
  MOK_REQUIRE((x_peers == nullptr) == (x_rows == nullptr), "pull_reverse_combine.x_rows",
              "x_peers and x_rows must be given together (or neither)");
  reverse_combine_kernel<<<a.sms, kThreads, 0, stream>>>(
      a.schedule, static_cast<int>(a.hidden / 8), static_cast<int>(a.top_k), a.row_begin, a.row_end,
      reinterpret_cast<const uint4* const*>(d_out_peers), weight_peers, static_cast<uint4*>(dy_routed), row_weight,
      reinterpret_cast<const uint4* const*>(x_peers), static_cast<uint4*>(x_rows), a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void publish_call_id(void* words, int64_t id, int64_t layer, cudaStream_t stream) {
  MOK_REQUIRE(words && reinterpret_cast<uintptr_t>(words) % 16 == 0, "publish_call_id",
              "the call words must be non-null and 16-byte aligned");
  publish_call_kernel<<<1, 1, 0, stream>>>(static_cast<int64_t*>(words), id, layer);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void check_call_ids(const void* const* peers, int world, int64_t id, int64_t layer, int rank,
                    unsigned long long* error_word, const uint32_t* abort, cudaStream_t stream) {
  MOK_REQUIRE(peers && world >= 1, "check_call_ids", "needs the peers' call words");
  check_calls_kernel<<<1, 32, 0, stream>>>(reinterpret_cast<const int64_t* const*>(peers), world, id, layer, rank,
                                           error_word, abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void push_router_grad(const MoveArgs& a, const float* partial, int64_t parts, float* const* d_weight_peers,
                      cudaStream_t stream, const void* y_routed, void* const* combine_peers) {
  check_move_args(a);
  MOK_REQUIRE(partial && d_weight_peers, "push_router_grad", "partial and d_weight_peers must be non-null");
  MOK_REQUIRE(parts >= 1 && parts <= 1 << 20, "push_router_grad.parts", "in [1, 2^20], got ", parts);
  MOK_REQUIRE((y_routed == nullptr) == (combine_peers == nullptr), "push_router_grad.combine_peers",
              "y_routed and combine_peers must be given together (or neither)");
  router_grad_push_kernel<<<a.sms, kThreads, 0, stream>>>(
      a.schedule, a.row_begin, a.row_end, partial, static_cast<int>(parts), d_weight_peers,
      static_cast<const uint4*>(y_routed), reinterpret_cast<uint4* const*>(combine_peers),
      static_cast<int>(a.hidden / 8), a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void finish_router_grad(const float* window, const int32_t* topk_idx, int64_t slots, const uint32_t* abort,
                        float* d_topk_w, cudaStream_t stream) {
  MOK_REQUIRE(slots >= 0, "finish_router_grad.slots", "must be >= 0, got ", slots);
  if (slots == 0) return;
  MOK_REQUIRE(window && topk_idx && d_topk_w, "finish_router_grad", "window, topk_idx and d_topk_w must be non-null");
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((slots + 255) / 256, 1024));
  router_grad_finish_kernel<<<blocks, 256, 0, stream>>>(window, topk_idx, slots, abort, d_topk_w);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gpu
