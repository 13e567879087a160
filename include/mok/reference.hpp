// mok — the CPU reference engine: the executable specification of the layer.
//
// It runs the whole EP layer for W simulated ranks in one process and executes mok's data layout,
// not only the math: each rank builds its receiver-side schedule (schedule_math.h), "pulls" routed
// rows from the source ranks into a fixed-size ring buffer (macrobatches, last first), runs its
// experts on padded per-expert segments, "pushes" each expert output row to the source rank's
// combine slot t*k + j, and every rank merges its slots in fixed j order.
//
// Rounding points (identical on the GPU path; "rnd" = round to nearest-even bf16, all sums fp32):
//   forward, per routed row v of expert e (router weight w, slot t*k+j):
//     g = rnd(v . Wg[e]^T),  u = rnd(v . Wu[e]^T)            (FC1 outputs, saved for backward)
//     h = rnd(silu(g) * u),  silu(g) = g / (1 + exp(-g))       (SwiGLU, fp32 math)
//     y = rnd(h . Wd[e]^T)                                     (FC2 output, pushed unweighted)
//   shared expert: y_s = the same FFN with the shared weights
//   merge: acc = y_s (0 without shared expert); for j = 0..k-1, non-empty: acc = fma(w_j, y_j, acc);
//          out = rnd(acc)
//   backward, per routed row (d = d_out[t] of the source token, pulled unweighted):
//     gd = rnd(d . Wd[e])                                      (FC2's dgrad of the unweighted row)
//     dh = rnd(w * gd)
//     s = 1/(1+exp(-g));  du = rnd(g*s * dh);  dg = rnd(s*(1 + g*(1-s)) * u * dh)
//     dx = rnd(dg . Wg[e] + du . Wu[e])                        (one fp32 sum, gate terms first)
//     d_topk_w[t,j] = sum_i gd[i] * h[i]                       (fp32, increasing i: <d, y> before
//                     y's rounding, so the backward needs no y row of the forward; the GPU sums
//                     64 columns at a time, then the sums in order)
//     hw = rnd(w * h)                                          (dW_down's rows, with d)
//   shared expert: the same with w = 1 (dh = gd, hw = h)
//   d_x merge: acc = dx_s (0 without shared); for j = 0..k-1, non-empty: acc += dx_j; d_x = rnd(acc)
//   weight gradients: dWd[e] = rnd(sum_rows d^T hw), dWg[e] = rnd(sum_rows dg^T v),
//     dWu[e] = rnd(sum_rows du^T v); fp32 sums over the expert's rows in increasing
//     (source rank, slot) order, i.e. global token order, so they do not depend on W.
//     Shared-expert gradients are per rank, over that rank's tokens in increasing t.
// Config::precision FP8 (recipe 1): x rows quantized per 1 x 128 at their source,
//   every weight matrix ([I, H] gate and up, [H, I] down, per expert and the shared expert's) per
//   128 x 128, and h per 1 x 128 after its rounding, all with fp32 scales amax / 448
//   (src/reference/fp8_quant.h); each value then stands for what its E4M3 code and scale decode
//   to, and the GEMMs and rounding points are the bf16 ones above. The GPU's FP8 forms compute
//   with the same codes and scales (they differ by accumulation order only).
//   Its backward (the spec; the GPU has its GEMM forms, not yet the layer's FP8 backward): FC2's
//   dgrad reads d per 1 x 128 along H against the forward's W_down codes (128 x 128 blocks are
//   the same transposed); FC1's dgrad reads [dg du] per 1 x 128 in the packed K order (the gate
//   and up values of the same 64 intermediate columns) against [W_gate; W_up] quantized in the
//   same blocks (64 gate and 64 up rows x 128 hidden columns per scale, from the bf16 weights:
//   not the forward's codes, whose blocks do not line up with that order); the weight gradients
//   read d, hw, dg, du and the bf16 x rows per 128 x 1 block (K = tokens: 128 consecutive rows of
//   the expert's rows in the order above, i.e. one 128-row M tile of its segment, so the same
//   blocks in every ring and W; the shared expert's per 128 of the rank's tokens); hw and d_topk_w
//   use the bf16 h = rnd(silu(g) u) (recomputed from g, u as in BF16; not its FP8 rounding).
// Config::precision MXFP8 (recipe 2): the same points, each quantized as MXFP8 (E4M3 with an E8M0
//   scale per 32 consecutive values along that GEMM's K): forward x and h rows and weight rows; the
//   backward's d rows along H and [dg du] rows along 2I (its 32-blocks all gate or all up), the
//   dgrads' weights along their K (W_down along H, W_gate and W_up along I: from the bf16 weights,
//   the other axis than the forward's), and the weight gradients' operands per 32 x 1 block along
//   the tokens (32 divides the 128-row tiles, so the same blocks in every layout).
// Every dot product is an fp32 sum in increasing index order without fused multiply-add, and
// parallel work is split by output rows only, so results are bitwise independent of the thread
// count and of W (except the per-rank shared-expert gradients, which are partial sums).
#pragma once

#include <cstdint>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/config.hpp"
#include "mok/schedule.hpp"

namespace mok::ref {

// Weights of all E routed experts (rank r owns experts [r*E_loc, (r+1)*E_loc)) and of the
// shared expert, which every rank holds.
struct LayerWeights {
  std::vector<bf16> w_gate;   // [E, I, H]
  std::vector<bf16> w_up;     // [E, I, H]
  std::vector<bf16> w_down;   // [E, H, I]
  std::vector<bf16> ws_gate;  // [Is, H]
  std::vector<bf16> ws_up;    // [Is, H]
  std::vector<bf16> ws_down;  // [H, Is]
};

struct RankInput {
  std::vector<bf16> x;            // [T, H]
  std::vector<int32_t> topk_idx;  // [T, k]
  std::vector<float> topk_w;      // [T, k]
};

struct ForwardResult {
  std::vector<std::vector<bf16>> out;      // per rank [T, H]
  std::vector<ScheduleTable> schedules;    // per rank
  std::vector<int64_t> macrobatches;       // per rank: ring refills used
};

struct Gradients {
  std::vector<std::vector<bf16>> d_x;        // per rank [T, H]
  std::vector<std::vector<float>> d_topk_w;  // per rank [T, k]; 0 for empty slots
  std::vector<bf16> d_w_gate;                // [E, I, H]
  std::vector<bf16> d_w_up;                  // [E, I, H]
  std::vector<bf16> d_w_down;                // [E, H, I]
  std::vector<std::vector<bf16>> d_ws_gate;  // per rank [Is, H] (that rank's tokens only)
  std::vector<std::vector<bf16>> d_ws_up;    // per rank [Is, H]
  std::vector<std::vector<bf16>> d_ws_down;  // per rank [H, Is]
};

class Engine {
 public:
  // Validates shape and config (throws mok::Error).
  Engine(LayerShape shape, Config config);

  const LayerShape& shape() const { return shape_; }
  const Config& config() const { return config_; }

  // Validates every input (layouts and values) and runs the forward pass of all ranks.
  ForwardResult forward(const std::vector<RankInput>& in, const LayerWeights& w) const;
  // Backward of all ranks given d_out per rank ([T, H]); recomputes the forward activations.
  Gradients backward(const std::vector<RankInput>& in, const LayerWeights& w,
                     const std::vector<std::vector<bf16>>& d_out) const;

 private:
  void validate_inputs(const std::vector<RankInput>& in, const LayerWeights& w) const;
  LayerShape shape_;
  Config config_;
};

}  // namespace mok::ref
