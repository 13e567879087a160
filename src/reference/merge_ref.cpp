#include "reference/merge_ref.h"

#include <cmath>

#include "reference/cpu_math.h"

namespace mok::ref {

std::vector<bf16> merge_rows(const float* shared, const float* slots, const float* weights,
                             const int32_t* topk_idx, int64_t tokens, int64_t top_k,
                             int64_t hidden, int threads) {
  std::vector<bf16> out(static_cast<size_t>(tokens * hidden));
  parallel_for(tokens, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < hidden; ++h) {
        float acc = shared ? shared[t * hidden + h] : 0.0f;
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t slot = t * top_k + j;
          if (topk_idx[slot] < 0) continue;
          const float y = slots[slot * hidden + h];
          acc = weights ? std::fma(weights[slot], y, acc) : acc + y;
        }
        out[static_cast<size_t>(t * hidden + h)] = bf16(acc);
      }
    }
  });
  return out;
}

}  // namespace mok::ref
