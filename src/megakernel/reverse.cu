#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "gemm/swiglu_math.cuh"
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

// One warp per routed row (warps of all CTAs stride over the window's rows), four 16-byte loads in
// flight per lane: the rows come over NVLink from the source rank.
__global__ void __launch_bounds__(kThreads) reverse_combine_kernel(ScheduleView s, int hidden_vecs, int top_k,
                                                                   int64_t row_begin, int64_t row_end,
                                                                   const uint4* const* d_out_peers,
                                                                   const float* const* weight_peers,
                                                                   uint4* __restrict__ dy, const uint32_t* abort) {
  for_each_window_row(s, row_begin, row_end, abort, [&](int64_t row, int lane) {
    const int src = s.src_rank[row];
    uint4* to = dy + (row - row_begin) * hidden_vecs;
    if (src < 0) {
      zero_row(to, hidden_vecs, lane);
      return;
    }
    const int slot = s.src_slot[row];
    const float w = weight_peers[src][slot];
    const uint4* from = d_out_peers[src] + static_cast<int64_t>(slot / top_k) * hidden_vecs;
    int v = lane;
    for (; v + 96 < hidden_vecs; v += 128) {
      const uint4 a = from[v], b = from[v + 32], c = from[v + 64], d = from[v + 96];
      to[v] = scale_row_vec(a, w);
      to[v + 32] = scale_row_vec(b, w);
      to[v + 64] = scale_row_vec(c, w);
      to[v + 96] = scale_row_vec(d, w);
    }
    for (; v < hidden_vecs; v += 32) to[v] = scale_row_vec(from[v], w);
  });
}

// One warp per slot (t, j). After a failure (abort set) the slots may hold rows nobody pushed:
// every gradient is NaN then, never a plausible wrong value.
__global__ void __launch_bounds__(256) router_grad_kernel(const uint4* __restrict__ d_out,
                                                          const uint4* __restrict__ y,
                                                          const int32_t* __restrict__ topk_idx, int64_t slots,
                                                          int top_k, int hidden_vecs, const uint32_t* abort,
                                                          float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const bool aborted = abort_seen(abort);
  for (int64_t slot = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; slot < slots;
       slot += warps) {
    if (aborted || topk_idx[slot] < 0) {  // empty slot: no row was pushed there
      if (lane == 0) out[slot] = aborted ? __int_as_float(0x7fc00000) : 0.0f;
      continue;
    }
    const uint4* d = d_out + (slot / top_k) * hidden_vecs;
    const uint4* yr = y + slot * hidden_vecs;
    float acc = 0.0f;
    for (int v = lane; v < hidden_vecs; v += 32) {
      Pack8 a, b;
      a.raw = d[v];
      b.raw = yr[v];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 fa = __bfloat1622float2(a.h2[q]), fb = __bfloat1622float2(b.h2[q]);
        acc = __fadd_rn(acc, __fmul_rn(fa.x, fb.x));
        acc = __fadd_rn(acc, __fmul_rn(fa.y, fb.y));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) out[slot] = acc;
  }
}

// One thread per 8 h columns of a row (one 16-byte load of gate and one of up: in the packed
// order a group of 32 intermediate columns is 32 gate then 32 up values), rows of tiles whose
// expert is -1 skipped.
__global__ void __launch_bounds__(256) swiglu_rows_kernel(const uint4* __restrict__ gu, uint4* __restrict__ h,
                                                          int64_t inter, const int32_t* __restrict__ tile_expert,
                                                          int64_t rows) {
  const int64_t vecs = inter / 8, n = rows * vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs, c = (i % vecs) * 8;
    if (tile_expert[row / sched::kBlockM] < 0) continue;
    const int64_t g_col = gemm::packed_gate_row(c), u_col = gemm::packed_up_row(c);
    Pack8 g, u, out;
    g.raw = gu[(row * 2 * inter + g_col) / 8];
    u.raw = gu[(row * 2 * inter + u_col) / 8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 fg = __bfloat1622float2(g.h2[q]), fu = __bfloat1622float2(u.h2[q]);
      out.h2[q] = __floats2bfloat162_rn(gemm::swiglu_of_bf16(fg.x, fu.x), gemm::swiglu_of_bf16(fg.y, fu.y));
    }
    h[i] = out.raw;
  }
}

// One block: every expert's part of window [lo, hi), then (thread 0, in expert order) the experts
// carried across the window's two ends (schedule_math.h: at most one per cut).
__global__ void window_parts_kernel(const int32_t* expert_offset, const int32_t* expert_rows, int32_t experts,
                                    int64_t lo, int64_t hi, int32_t* parts) {
  for (int32_t e = int32_t(threadIdx.x); e < experts; e += int32_t(blockDim.x)) {
    const sched::WindowPart p = sched::window_part(expert_offset[e], expert_rows[e], lo, hi);
    parts[e] = p.begin;
    parts[experts + e] = p.rows;
  }
  if (threadIdx.x == 0) {
    int32_t in = -1, out = -1;
    for (int32_t e = 0; e < experts; ++e) {
      if (sched::rows_cross(expert_offset[e], expert_rows[e], lo)) in = e;
      if (sched::rows_cross(expert_offset[e], expert_rows[e], hi)) out = e;
    }
    parts[2 * experts] = in;
    parts[2 * experts + 1] = out;
  }
}

}  // namespace

void window_parts(const ScheduleView& v, int64_t experts, int64_t lo, int64_t hi, int32_t* parts,
                  cudaStream_t stream) {
  MOK_REQUIRE(experts >= 1 && experts < (int64_t(1) << 24), "window_parts.experts", "in [1, 2^24), got ", experts);
  MOK_REQUIRE(lo >= 0 && hi > lo && lo % sched::kBlockM == 0 && hi % sched::kBlockM == 0, "window_parts.lo/hi",
              "a window of whole ", sched::kBlockM, "-row tiles, got [", lo, ", ", hi, ")");
  window_parts_kernel<<<1, 256, 0, stream>>>(v.expert_offset, v.expert_rows, int32_t(experts), lo, hi, parts);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void swiglu_rows(const void* gu, void* h, int64_t inter, const int32_t* tile_expert, int64_t tiles,
                 cudaStream_t stream) {
  MOK_REQUIRE(inter > 0 && inter % 64 == 0, "swiglu_rows.inter", "must be a positive multiple of 64, got ", inter);
  MOK_REQUIRE(tiles >= 0, "swiglu_rows.tiles", "must be >= 0, got ", tiles);
  if (tiles == 0) return;
  MOK_REQUIRE(gu && h && tile_expert, "swiglu_rows", "gu, h and tile_expert must be non-null");
  const int64_t n = tiles * sched::kBlockM * (inter / 8);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 8192));
  swiglu_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(gu), static_cast<uint4*>(h), inter,
                                                 tile_expert, tiles * sched::kBlockM);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void pull_reverse_combine(const MoveArgs& a, const void* const* d_out_peers, const float* const* weight_peers,
                          void* dy_routed, cudaStream_t stream) {
  check_move_args(a);
  MOK_REQUIRE(d_out_peers && weight_peers && dy_routed, "pull_reverse_combine",
              "d_out_peers, weight_peers and dy_routed must be non-null");
  reverse_combine_kernel<<<a.sms, kThreads, 0, stream>>>(
      a.schedule, static_cast<int>(a.hidden / 8), static_cast<int>(a.top_k), a.row_begin, a.row_end,
      reinterpret_cast<const uint4* const*>(d_out_peers), weight_peers, static_cast<uint4*>(dy_routed), a.abort);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void router_weight_grad(const RouterGradArgs& a, cudaStream_t stream) {
  MOK_REQUIRE(a.hidden > 0 && a.hidden % 8 == 0, "hidden", "must be a positive multiple of 8, got ", a.hidden);
  MOK_REQUIRE(a.tokens >= 0 && a.top_k >= 1, "tokens/top_k", "need T >= 0 and k >= 1, got T = ", a.tokens,
              ", k = ", a.top_k);
  if (a.tokens == 0) return;
  MOK_REQUIRE(a.d_out && a.y_slots && a.topk_idx && a.d_topk_w, "router_weight_grad",
              "d_out, y_slots, topk_idx and d_topk_w must be non-null");
  const int64_t slots = a.tokens * a.top_k;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((slots * 32 + 255) / 256, 4096));
  const auto* d = static_cast<const uint4*>(a.d_out);
  const auto* y = static_cast<const uint4*>(a.y_slots);
  const int k = static_cast<int>(a.top_k), hv = static_cast<int>(a.hidden / 8);
  router_grad_kernel<<<blocks, 256, 0, stream>>>(d, y, a.topk_idx, slots, k, hv, a.abort, a.d_topk_w);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::gpu
