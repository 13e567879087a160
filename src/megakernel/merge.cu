#include <cuda_bf16.h>

#include "common/cuda_check.h"
#include "megakernel/merge.h"
#include "mok/errors.hpp"

namespace mok::gpu {

namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access

union Pack8 {
  uint4 raw;
  __nv_bfloat162 h2[4];
};

// One thread merges 8 consecutive hidden values of one token. Loads are 16 bytes wide and
// coalesced along H; the j loop is sequential, which fixes the summation order. After a failure
// (abort set) the slots may hold rows nobody delivered: the output is NaN then, never a plausible
// wrong value.
template <bool kWeighted>
__global__ void __launch_bounds__(256) merge_kernel(const uint4* __restrict__ shared,
                                                    const uint4* __restrict__ slots,
                                                    const float* __restrict__ weights,
                                                    const int32_t* __restrict__ topk_idx, int tokens,
                                                    int top_k, int hidden_vecs, const uint32_t* abort,
                                                    uint4* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(tokens) * hidden_vecs) return;
  // Read now, used at the end: the row loads below do not wait for this load's round trip (the
  // slots are valid memory either way; an aborted merge only discards what it read).
  const uint32_t aborted = abort != nullptr ? *reinterpret_cast<const volatile uint32_t*>(abort) : 0u;
  const int t = static_cast<int>(i / hidden_vecs);
  const int v = static_cast<int>(i % hidden_vecs);
  float acc[kVec];
  if (shared != nullptr) {
    Pack8 s;
    s.raw = shared[i];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(s.h2[q]);
      acc[2 * q] = f.x;
      acc[2 * q + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int q = 0; q < kVec; ++q) acc[q] = 0.0f;
  }
  for (int j = 0; j < top_k; ++j) {
    const int64_t slot = static_cast<int64_t>(t) * top_k + j;
    if (topk_idx[slot] < 0) continue;
    Pack8 y;
    y.raw = slots[slot * hidden_vecs + v];
    const float w = kWeighted ? weights[slot] : 1.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(y.h2[q]);
      if constexpr (kWeighted) {
        acc[2 * q] = __fmaf_rn(w, f.x, acc[2 * q]);
        acc[2 * q + 1] = __fmaf_rn(w, f.y, acc[2 * q + 1]);
      } else {
        acc[2 * q] = __fadd_rn(acc[2 * q], f.x);
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], f.y);
      }
    }
  }
  Pack8 o;
#pragma unroll
  for (int q = 0; q < 4; ++q) o.h2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  out[i] = aborted != 0u ? make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u) : o.raw;  // bf16 quiet NaN
}

template <bool kWeighted>
void launch(const MergeArgs& a, cudaStream_t stream) {
  MOK_REQUIRE(a.hidden > 0 && a.hidden % kVec == 0, "hidden", "must be a positive multiple of 8, got ", a.hidden);
  MOK_REQUIRE(a.tokens >= 0 && a.top_k >= 1, "tokens/top_k", "need T >= 0 and k >= 1, got T = ", a.tokens, ", k = ", a.top_k);
  if (a.tokens == 0) return;
  MOK_REQUIRE(a.slots && a.topk_idx && a.out, "merge", "slots, topk_idx and out must be non-null");
  MOK_REQUIRE(!kWeighted || a.weights, "weights", "the forward merge needs router weights");
  const int64_t hv = a.hidden / kVec, n = a.tokens * hv;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((n + threads - 1) / threads);
  const auto* sh = static_cast<const uint4*>(a.shared);
  const auto* sl = static_cast<const uint4*>(a.slots);
  auto* out = static_cast<uint4*>(a.out);
  merge_kernel<kWeighted><<<blocks, threads, 0, stream>>>(sh, sl, a.weights, a.topk_idx, static_cast<int>(a.tokens),
                                                         static_cast<int>(a.top_k), static_cast<int>(hv), a.abort, out);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void merge_forward(const MergeArgs& a, cudaStream_t stream) { launch<true>(a, stream); }
void merge_backward(const MergeArgs& a, cudaStream_t stream) { launch<false>(a, stream); }

}  // namespace mok::gpu
