// mok — where the GPU layer's FP8 backward (layer_fp8_backward.cu) keeps its operands, shared by
// the layer and the memory plan (memory_plan.cpp), so the plan's bytes are the bytes it uses.
// Two buffers, both of the backward's scope (with Config::share_workspace: one for all layers):
//   fp8_bwd_rows    the routed rows' E4M3 operands. d_y and [d_g d_u] are each quantized once into
//                   both of their forms (1 x 128 rows for the dgrads, 128 x 1 token blocks for the
//                   wgrads: quantize_fp8_rows_and_token_blocks_t), so their token blocks live from
//                   then to the wgrads, beside (w h)^T; one more region is used in turn by d_y's
//                   rows (read by FC2's dgrad), [d_g d_u]'s rows (FC1's dgrad), then x^T (read
//                   from the x windows by the quantizer itself: no routed bf16 copy of x).
//   fp8_bwd_weights the dgrads' K-major weight codes, made by each backward from the bf16 weights:
//                   W_down^T [E, I, H] and [W_gate; W_up]^T packed [E, H, 2I], with their
//                   128 x 128 scales (not kept across calls: per layer x 58 they would cost as much
//                   as the forward's codes again; with a shared workspace one copy serves all),
//                   unless Config::fp8_keep_weight_codes_t (then the layer's own, made with the
//                   forward's codes by the weight binding).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "mok/config.hpp"

namespace mok::fp8_bwd {

// Offsets are kept 1 KiB aligned (TMA wants 16 bytes; scales 16).
inline int64_t align(int64_t b) { return (b + 1023) / 1024 * 1024; }

struct RowsLayout {
  // token blocks (K-major codes, then [rows / 128, cols] scales), kept until the wgrads
  int64_t t_dy, ts_dy, t_dgu, ts_dgu, t_hw, ts_hw;
  // one region in turn: d_y's 1 x 128 codes + scales, then [d_g d_u]'s, then x^T's token blocks
  int64_t q_dy, s_dy, q_dgu, s_dgu, t_x, ts_x;
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
  L.t_dy = take(rows * H);
  L.ts_dy = take(rows / 128 * H * 4);
  L.t_dgu = take(rows * 2 * I);
  L.ts_dgu = take(rows / 128 * 2 * I * 4);
  L.t_hw = take(rows * I);
  L.ts_hw = take(rows / 128 * I * 4);
  const int64_t shared = at;
  int64_t end = at;
  const auto region = [&](int64_t cols, int64_t scale_bytes, int64_t& codes, int64_t& scales) {
    at = shared;
    codes = take(rows * cols);
    scales = take(scale_bytes);
    end = std::max(end, at);
  };
  region(H, rows * (H / 128) * 4, L.q_dy, L.s_dy);
  region(2 * I, rows * (2 * I / 128) * 4, L.q_dgu, L.s_dgu);
  region(H, rows / 128 * H * 4, L.t_x, L.ts_x);
  L.bytes = end;
  return L;
}

// d_y at its source (recipe 1's training path, one rank): d_y's routed rows are d_out's rows
// unweighted (FC2's dgrad applies the router weight), so the T rows are quantized 1 x 128 once, into
// the d_out window after the bf16 rows, and pulled as codes and scales into routed order; the token
// blocks are gathered from the bf16 rows where they live, as x's are. The same values in the same
// blocks as quantizing a routed bf16 copy, so the same bits, with 1/k of the row quantization and
// no routed copy. Not at EP > 1: there the token blocks' gather would read the bf16 rows over
// NVLink besides the codes (3 bytes per element instead of the routed copy's pull of 2), and the
// link, not HBM, is what the reverse combine waits for. (MXFP8 keeps the routed copy too: its rows
// are MX-quantized then re-blocked.)
inline bool dy_at_source(const LayerShape& s, const Config& c) {
  return c.precision == Precision::FP8 && c.forward_path == ForwardPath::Unfused && s.world_size() == 1;
}
// The d_out window: bf16 rows [t_pad, H], then (dy_at_source) codes [t_pad, H] and scales
// [t_pad, H / 128] f32 at these byte offsets; bytes = the window's size.
struct DoutWindow {
  int64_t codes, scales, bytes;
};
inline DoutWindow dout_window(int64_t t_pad, int64_t H, bool at_source) {
  const int64_t rows_bytes = std::max<int64_t>(t_pad * H, 1) * 2;
  if (!at_source) return DoutWindow{-1, -1, rows_bytes};
  const auto a16 = [](int64_t b) { return (b + 15) / 16 * 16; };
  const int64_t codes = a16(rows_bytes), scales = codes + a16(t_pad * H);
  return DoutWindow{codes, scales, scales + t_pad * (H / 128) * 4};
}
// The routed bf16 copy's path instead (the GPU test compares the two bitwise): off unless a test
// sets it.
inline std::atomic<bool>& dy_routed_copy_for_testing() {
  static std::atomic<bool> on{false};
  return on;
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
