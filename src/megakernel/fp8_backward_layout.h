// mok — where the GPU layer's FP8 backward (layer_fp8_backward.cu) keeps its operands, shared by
// the layer and the memory plan (memory_plan.cpp), so the plan's bytes are the bytes it uses.
// Two buffers, both of the backward's scope (with Config::share_workspace: one for all layers):
//   fp8_bwd_rows    the routed rows' E4M3 operands, two phases over the same bytes:
//                   dgrads  d_y [rows, H] + 1 x 128 scales, [d_g d_u] [rows, 2I] + 1 x 128 scales;
//                   wgrads  d_y^T, (w h)^T, [d_g d_u]^T, x^T, K-major (K = rows) + 128 x 1 scales.
//                   The wgrads' operands are made after FC1's dgrad has read the dgrads' ones.
//   fp8_bwd_weights the dgrads' K-major weight codes, made by each backward from the bf16 weights:
//                   W_down^T [E, I, H] and [W_gate; W_up]^T packed [E, H, 2I], with their
//                   128 x 128 scales (not kept across calls: per layer x 58 they would cost as much
//                   as the forward's codes again; with a shared workspace one copy serves all).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mok::fp8_bwd {

// Offsets are kept 1 KiB aligned (TMA wants 16 bytes; scales 16).
inline int64_t align(int64_t b) { return (b + 1023) / 1024 * 1024; }

struct RowsLayout {
  // dgrads' phase
  int64_t q_dy, s_dy, q_dgu, s_dgu;
  // wgrads' phase (K-major codes, then [rows / 128, cols] scales)
  int64_t t_dy, ts_dy, t_hw, ts_hw, t_dgu, ts_dgu, t_x, ts_x;
  int64_t bytes;
};

// rows: the routed rows (a multiple of 128); H, I multiples of 128.
inline RowsLayout rows_layout(int64_t rows, int64_t H, int64_t I) {
  RowsLayout L{};
  int64_t at = 0;
  const auto take = [&](int64_t b) {
    const int64_t o = at;
    at += align(b);
    return o;
  };
  L.q_dy = take(rows * H);
  L.s_dy = take(rows * (H / 128) * 4);
  L.q_dgu = take(rows * 2 * I);
  L.s_dgu = take(rows * (2 * I / 128) * 4);
  const int64_t dgrads = at;
  at = 0;
  L.t_dy = take(rows * H);
  L.ts_dy = take(rows / 128 * H * 4);
  L.t_hw = take(rows * I);
  L.ts_hw = take(rows / 128 * I * 4);
  L.t_dgu = take(rows * 2 * I);
  L.ts_dgu = take(rows / 128 * 2 * I * 4);
  L.t_x = take(rows * H);
  L.ts_x = take(rows / 128 * H * 4);
  L.bytes = std::max(dgrads, at);
  return L;
}

struct WeightsLayout {
  int64_t q_wd, s_wd, q_w1, s_w1, bytes;
};

inline WeightsLayout weights_layout(int64_t experts, int64_t H, int64_t I) {
  WeightsLayout L{};
  const int64_t codes = experts * I * H, scales = experts * (I / 128) * (H / 128) * 4;
  L.q_wd = 0;
  L.s_wd = align(codes);
  L.q_w1 = L.s_wd + align(scales);
  L.s_w1 = L.q_w1 + align(2 * codes);
  L.bytes = L.s_w1 + align(2 * scales);
  return L;
}

}  // namespace mok::fp8_bwd
