// mok — the GPU layer's forward in FP8 (Config::precision FP8, recipe 1: block-scaled E4M3,
// notes/fp8.md), on the unfused path:
//   x (bf16, the caller's) -> E4M3 codes + 1 x 128 scales written straight into the x window (the
//   quantization replaces the bf16 copy: one pass over x, at its source); pull dispatch moves the
//   codes and the scales of every routed row (about half the bf16 bytes); FC1 + SwiGLU in FP8
//   writes h as E4M3 + 1 x 128 scales; FC2 in FP8 writes bf16 rows; combine and merge as in bf16.
// The weights' codes and 128 x 128 scales are made by bind_weights (construction and every
// set_weights: call set_weights again, with the same pointers, after the weights change). The
// CPU reference computes the same recipe (include/mok/reference.hpp): the two differ by
// accumulation order and the SFU's exp in SwiGLU. The backward: layer_fp8_backward.cu.
// MXFP8 (Config::precision MXFP8, recipe 2; its backward too) runs on the same forms: x, the
// weights and h are quantized as MX (E4M3, an E8M0 scale per 32 along K) and then re-blocked to
// the 1 x 128 / 128 x 128 blocks at the largest of their power-of-two scales
// (gemm::quantize_mxfp8_reblocked, Fp8Fc1Args::h_mx; the megakernel: forward_kernel_mxfp8.cu). The
// re-blocking moves a value only where its E4M3 code would fall below the block's 14 normal binades
// (notes/fp8.md, "MXFP8 on Hopper"): the CPU reference's MX spec and the GPU differ by that and by
// accumulation order.
// Buffers: the x window and h hold codes then scales in their bf16 bytes (x window: T_max_pad x H
// codes, then the scales; h: cap x I codes, then cap x I / 128 scales); x_routed is sized for
// codes and scales only (cap x H, then cap x H / 128: memory_plan.cpp); "fp8_weights" holds the
// weight codes and scales; the backward's gu and operand buffers: layer_fp8_backward.cu.
#include <cuda_runtime.h>

#include "gemm/fp8_quantize.h"
#include "gemm/tensor_map.h"
#include "megakernel/fp8_backward_layout.h"
#include "megakernel/layer_impl.h"
#include "schedule/schedule_math.h"

namespace mok {

namespace {

// The weight codes [E, I, H] gate, up, [E, H, I] down, then their scales, in the fp8_weights buffer.
struct Fp8WeightLayout {
  int64_t gate, up, down, s_gate, s_up, s_down;
};
Fp8WeightLayout fp8_weight_layout(int64_t e, int64_t H, int64_t I) {
  const int64_t codes = e * I * H, scales = e * (I / 128) * (H / 128) * 4;
  return {0, codes, 2 * codes, 3 * codes, 3 * codes + scales, 3 * codes + 2 * scales};
}

// FP8 FC1's arguments over the bound weights' codes (`base`: the fp8_weights buffer), x's codes
// and h's codes + scales as given: the unfused forward's plans and a window's FC1 again.
gemm::Fp8Fc1Args fc1_fp8_args(char* base, int64_t e, int64_t H, int64_t I, bool mx, const void* x, const float* xs,
                              void* h, float* hs) {
  const Fp8WeightLayout L = fp8_weight_layout(e, H, I);
  const auto scales = [&](int64_t off) { return reinterpret_cast<float*>(base + off); };
  gemm::Fp8Fc1Args a;
  a.x = x;
  a.x_scales = xs;
  a.w_gate = base + L.gate;
  a.w_gate_scales = scales(L.s_gate);
  a.w_up = base + L.up;
  a.w_up_scales = scales(L.s_up);
  a.h = h;
  a.h_scales = hs;
  a.hidden = H;
  a.inter = I;
  a.h_mx = mx;
  a.experts = e;
  return a;
}

}  // namespace

// The constructor's check of what the FP8 layer supports so far (each refusal names its knob).
void Layer::Impl::check_precision() const {
  if (config.precision == Precision::BF16) return;
  const char* p = to_string(config.precision);  // fp8 or mxfp8: the same runtime (MX re-blocked)
  if (config.forward_path == ForwardPath::Megakernel) {  // (forward_kernel_fp8.cu, forward_kernel_mxfp8.cu)
    MOK_REQUIRE(!config.fwd_clusters, "config.fwd_clusters", "must be off with config.precision ", p);
    MOK_REQUIRE(config.dispatch == DispatchPath::Pull, "config.dispatch", "must be pull with config.precision ", p);
    MOK_REQUIRE(H % 512 == 0, "shape.hidden", "must be a multiple of 512 with config.precision ", p,
                " on the megakernel (a row's 1 x 128 scales move as whole 16-byte pieces), got ", H);
  }
  MOK_REQUIRE(Is == 0, "shape.shared_intermediate", "must be 0 with config.precision ", p,
              " (the shared expert runs bf16 only so far), got ", Is);
  MOK_REQUIRE(H % 128 == 0, "shape.hidden", "must be a multiple of 128 with config.precision ", p,
              " (whole 1 x 128 and 128 x 128 scale blocks), got ", H);
  MOK_REQUIRE(I % 128 == 0, "shape.intermediate", "must be a multiple of 128 with config.precision ", p,
              " (whole 1 x 128 and 128 x 128 scale blocks), got ", I);
}

// Byte offset of the 1 x 128 scales in every rank's x window (after T_max_pad x H codes).
int64_t Layer::Impl::x_scale_offset() const { return sched::pad_rows(shape.max_tokens()) * H; }

// The weights' E4M3 codes and 128 x 128 scales (the expert matrices are stacked: I and H are
// multiples of 128, so no block straddles two experts), then the FP8 GEMM plans. Synchronous:
// the caller may change the bf16 weights as soon as this returns.
void Layer::Impl::bind_weights_fp8() {
  // The codes are rewritten in place: every call still running (on any stream) must be done, and
  // the caller's weight updates (its stream) and the new buffer's zeroing (the legacy stream)
  // complete, before the quantization (on the communicator's non-blocking stream) starts.
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  if (!fp8_weights.p) {
    fp8_weights = allocate("fp8_weights", "fp8 weight codes and scales");
    MOK_CUDA_CHECK(cudaDeviceSynchronize());  // its zeroing (legacy stream) before our writes
  }
  const Fp8WeightLayout L = fp8_weight_layout(e_loc, H, I);
  auto* base = static_cast<char*>(fp8_weights.p);
  const auto scales = [&](int64_t off) { return reinterpret_cast<float*>(base + off); };
  const cudaStream_t s = comm.stream();
  if (e_loc > 0) {
    quantize_weight(weights.w_gate.data, e_loc * I, H, base + L.gate, scales(L.s_gate), s);
    quantize_weight(weights.w_up.data, e_loc * I, H, base + L.up, scales(L.s_up), s);
    quantize_weight(weights.w_down.data, e_loc * H, I, base + L.down, scales(L.s_down), s);
  }
  if (config.fp8_keep_weight_codes_t) {  // the backward's codes too, kept (Config::fp8_keep_weight_codes_t)
    if (!fp8_bwd_weights.p) {
      fp8_bwd_weights = allocate("fp8_bwd_weights", "fp8 backward weight codes");
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
    }
    fp8_backward_weight_codes(s);
  }
  MOK_CUDA_CHECK(cudaStreamSynchronize(s));
  if (fused) {  // the megakernel's weight maps (E4M3) and scales
    using gemm::make_map_3d;
    const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
    constexpr int64_t kBN = mk::kForwardBlockN;
    constexpr auto kBox = static_cast<uint32_t>(gemm::kGateUpGroup);
    constexpr auto e4m3 = gemm::MapType::E4M3;
    maps.w_gate = make_map_3d(base + L.gate, u(e_loc), u(I), u(H), kBox, e4m3);
    maps.w_up = make_map_3d(base + L.up, u(e_loc), u(I), u(H), kBox, e4m3);
    maps.w_down = make_map_3d(base + L.down, u(e_loc), u(H), u(I), kBN, e4m3);
    maps.w_down_half = make_map_3d(base + L.down, u(e_loc), u(H), u(I), kBN / 2, e4m3);
    maps.ws_gate = maps.ws_up = maps.ws_down = maps.ws_down_half = maps.w_gate;  // (no shared expert)
    mkp.w_gate_scales = scales(L.s_gate);
    mkp.w_up_scales = scales(L.s_up);
    mkp.w_down_scales = scales(L.s_down);
    return;
  }
  const gpu::ScheduleView v = schedule->view();
  const int64_t tiles = cap_rows / sched::kBlockM;
  const auto routed = [&](auto& a) {  // both forms run over the routed rows' tiles of every local expert
    a.experts = e_loc;
    a.tile_expert = v.tile_expert;
    a.num_m_tiles = tiles;
  };
  auto* xr = static_cast<char*>(x_routed.p);
  auto* hr = static_cast<char*>(h.p);
  gemm::Fp8Fc1Args a1 = fc1_fp8_args(base, e_loc, H, I, mx, xr, reinterpret_cast<const float*>(xr + cap_rows * H), hr,
                                     reinterpret_cast<float*>(hr + cap_rows * I));
  routed(a1);
  fc1_fp8_nogu = gemm::plan_fp8_fc1(a1, gemm_options());
  a1.gu = gu.p;  // forward(..., save_for_backward): the bf16 gate/up rows the backward's SwiGLU' reads
  fc1_fp8 = gemm::plan_fp8_fc1(a1, gemm_options());
  gemm::Fp8GroupedArgs a2;
  a2.a = hr;
  a2.a_scales = a1.h_scales;
  a2.w = base + L.down;
  a2.w_scales = scales(L.s_down);
  a2.y = y.p;
  a2.k = I;
  a2.n = H;
  routed(a2);
  fc2_fp8 = gemm::plan_fp8_grouped(a2, gemm_options());
}

// FC1 again for a window of the FP8 backward over windows: the window's bf16 x rows (pulled into
// the ring) quantized per 1 x 128 as quantize_x_fp8 quantized them at their source (a row's codes
// are its own: the forward's bits), into the region of fp8_bwd_rows that d_y's codes take next
// (fp8_backward_layout.h), then the FP8 FC1 over the window's tiles with the bf16 gate/up rows
// into gu_rows, as the unfused forward's FC1 stores them (the same sums: the resident backward's
// bits). h's codes go to the h ring unread (FC2's dgrad computes h from the gate/up rows). Ring
// rows past the routed ones quantize whatever they hold: their tiles are -1, never read.
void Layer::Impl::fp8_fc1_again(const void* x_rows, int64_t rows, void* gu_rows, const int32_t* tile_expert,
                                int64_t tiles, cudaStream_t stream) {
  const fp8_bwd::RowsLayout RL = fp8_bwd::rows_layout(fp8_bwd_layout_rows(), H, I);
  auto* rb = static_cast<char*>(fp8_bwd_rows.p);
  auto* xs = reinterpret_cast<float*>(rb + RL.s_dy);
  if (mx)
    gemm::quantize_mxfp8_reblocked(x_rows, rows, H, 1, rb + RL.q_dy, xs, stream);
  else
    gemm::quantize_fp8_blocked(x_rows, rows, H, 1, fp8::ScaleRule::Fp32, rb + RL.q_dy, xs, stream);
  auto* hr = static_cast<char*>(h.p);
  gemm::Fp8Fc1Args a1 = fc1_fp8_args(static_cast<char*>(fp8_weights.p), e_loc, H, I, mx, rb + RL.q_dy, xs, hr,
                                     reinterpret_cast<float*>(hr + ring_rows * I));
  a1.tile_expert = tile_expert;
  a1.num_m_tiles = tiles;
  a1.gu = gu_rows;
  gemm::run(gemm::plan_fp8_fc1(a1, gemm_options()), stream);
}

// The megakernel's rings in FP8: codes, then their 1 x 128 scales, in the bf16 rings' bytes; the
// FC1 / FC2 A maps are E4M3 ones.
void Layer::Impl::setup_megakernel_fp8() {
  const int64_t R = ring_rows;
  auto* xr = static_cast<char*>(x_rows);
  auto* hr = static_cast<char*>(h.p);
  mkp.x_scales_ring = reinterpret_cast<float*>(xr + R * H);
  mkp.h_ring = hr;
  mkp.h_scales_ring = reinterpret_cast<float*>(hr + R * I);
  mkp.x_scale_offset = x_scale_offset();
  const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
  maps.x_ring = gemm::make_map_2d(xr, u(R), u(H), 128, gemm::MapType::E4M3);
  maps.h_in = gemm::make_map_2d(hr, u(R), u(I), 128, gemm::MapType::E4M3);
  maps.xs_in = maps.gus_out = maps.hs_out = maps.hs_in = maps.ys_out = maps.x_ring;  // (no shared expert)
}

// x quantized into this rank's x window (codes, then the scales at x_scale_offset()).
void Layer::Impl::quantize_x_fp8(const void* x, cudaStream_t stream) {
  if (T == 0) return;
  auto* win = static_cast<char*>(win_x->ptr);
  auto* sc = reinterpret_cast<float*>(win + x_scale_offset());
  if (mx)
    gemm::quantize_mxfp8_reblocked(x, T, H, 1, win, sc, stream);
  else
    gemm::quantize_fp8_blocked(x, T, H, 1, fp8::ScaleRule::Fp32, win, sc, stream);
}

// A weight matrix [rows, cols] (K = cols) into its E4M3 codes and 128 x 128 scales: recipe 1, or
// MXFP8 (1 x 32 E8M0 blocks along K) re-blocked to 128 x 128 power-of-two scales.
void Layer::Impl::quantize_weight(const void* w, int64_t rows, int64_t cols, void* q, float* sc,
                                  cudaStream_t stream) const {
  if (mx)
    gemm::quantize_mxfp8_reblocked(w, rows, cols, 128, q, sc, stream);
  else
    gemm::quantize_fp8_blocked(w, rows, cols, 128, fp8::ScaleRule::Fp32, q, sc, stream);
}

// The routed part of the FP8 forward: pull codes and scales, FC1 (h in FP8; with save, the bf16
// gate/up rows too), FC2 (bf16), push.
void Layer::Impl::routed_forward_fp8(cudaStream_t stream, bool save) {
  auto* xr = static_cast<char*>(x_routed.p);
  gpu::pull_dispatch_fp8(move_args(), x_peers.get<const void* const>(), x_scale_offset(), xr,
                         reinterpret_cast<float*>(xr + cap_rows * H), stream);
  gemm::run(save ? fc1_fp8 : fc1_fp8_nogu, stream);
  gemm::run(fc2_fp8, stream);
  gpu::push_combine(move_args(), y.p, combine_peers.get<void* const>(), stream);
}

}  // namespace mok
