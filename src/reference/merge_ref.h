// CPU form of the source-side merges (the GPU twin is src/megakernel/merge.cu):
//   forward:  out[t] = rnd(acc), acc = shared[t] (or 0); acc = fma(w[t,j], slots[t*k+j], acc)
//   backward: d_x[t] = rnd(acc), acc = shared[t] (or 0); acc = acc + slots[t*k+j]
// for j = 0..k-1 with topk_idx[t,j] >= 0. `shared` may be null; all rows are fp32 holding the
// (bf16-exact) values of the buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/bf16.hpp"

namespace mok::ref {

std::vector<bf16> merge_rows(const float* shared, const float* slots, const float* weights,
                             const int32_t* topk_idx, int64_t tokens, int64_t top_k,
                             int64_t hidden, int threads);

}  // namespace mok::ref
