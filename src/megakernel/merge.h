// mok — the merges that close each direction of the layer, on the source rank, after the
// post-kernel barrier:
//   forward:  out[t] = rnd(y_s[t] + sum_j fma(w[t,j], y[t*k+j]))   (fixed j order, fp32)
//   backward: d_x[t] = rnd(dx_s[t] + sum_j dx[t*k+j])              (fixed j order, fp32)
// Empty slots (topk_idx = -1) are skipped; their combine rows are never read. topk_idx is the
// forward's published routing (checked: an invalid entry of the caller's is -1 there), so a bad
// id can never select a slot nobody pushed. The arithmetic is the CPU reference's
// (include/mok/reference.hpp), so the two agree bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gpu {

struct MergeArgs {
  const void* shared = nullptr;    // [T, H] bf16 shared-expert output, or null
  const void* slots = nullptr;     // [T*k, H] bf16 combine (forward) / reverse-dispatch (backward) rows
  const float* weights = nullptr;  // [T, k] router weights (forward only)
  const int32_t* topk_idx = nullptr;  // [T, k], -1 = empty slot
  const uint32_t* abort = nullptr;    // the communicator's abort word: out is all NaN once it is set
  int64_t tokens = 0, top_k = 0, hidden = 0;  // H must be a multiple of 8
  void* out = nullptr;             // [T, H] bf16
};

// Forward merge (weighted). Throws mok::Error on bad arguments or a launch failure.
void merge_forward(const MergeArgs& a, cudaStream_t stream);
// Backward merge (unweighted; `weights` is ignored).
void merge_backward(const MergeArgs& a, cudaStream_t stream);

}  // namespace mok::gpu
