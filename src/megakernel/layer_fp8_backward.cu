// mok — the GPU layer's backward in FP8 (Config::precision FP8, recipe 1, notes/fp8.md "The
// backward in FP8"): resident after the unfused path's FP8 forward, or over windows of the ring
// after the FP8 megakernel's (layer_backward_windows.cu: per window the x rows pulled again, FC1
// again in FP8, then these steps over the window's rows, the weight gradients' fp32 sums carried
// across windows; the same bits). The same steps and movement as the bf16 backward
// (layer_backward.cu), its GEMMs on E4M3 operands:
//   pulls     d_y's 1 x 128 codes and scales + the router weights (reverse combine): d_y's rows are
//             d_out's rows unweighted, so each rank quantizes its own T rows in its d_out window
//             (backward()) and the routed rows are pulled as codes (fp8_bwd::dy_at_source: EP 1;
//             at EP > 1 and in MXFP8 bf16 rows are pulled and the routed copy quantized); x's rows are not
//             pulled: dW_gate/up's operand x^T (128 x 1 token blocks, which the forward's 1 x 128
//             codes cannot give exactly) is quantized from the bf16 rows where they live, in the
//             x windows (quantize_fp8_token_blocks_t_gather; over windows from the window's
//             pulled rows);
//   weights   W_down^T and [W_gate; W_up]^T as K-major codes with 128 x 128 scales (the dgrads' B),
//             made from the bf16 weights by every call (fp8_backward_layout.h says why), or once
//             per weight binding and kept (Config::fp8_keep_weight_codes_t);
//   FC2 dgrad d_y's 128 x 1 token blocks for dW_down gathered from the d_out windows (MXFP8: both
//             forms from the routed copy in one pass), then
//             the FP8 dgrad + SwiGLU' (d_gu over the saved gate/up rows, the router-weight
//             gradient's partial sums, the weighted h, all bf16);
//   FC1 dgrad [d_g d_u] per 1 x 128 (the packed K order; its token blocks in the same pass), the
//             FP8 dgrad into the d_x rows, pushed;
//   wgrads    w h and x per 128 x 1 token block, transposed (K = the expert's rows), then both FP8
//             weight gradients.
// The CPU reference's FP8 backward (ref::Engine::backward, include/mok/reference.hpp) is this recipe
// step for step: the two differ by accumulation order and the SFU's exp in SwiGLU'.
// Each quantization is still a pass over HBM of its own, one per operand (next: d_gu's codes in the
// dgrad's epilogue; notes/fp8.md).
// MXFP8 (recipe 2, `mx`): the same steps, every operand quantized as MX along its GEMM's K (1 x 32
// rows, 32 x 1 token blocks, the dgrads' weights by 32 along their transposed K) and re-blocked to
// recipe 1's blocks at the largest power-of-two scale of each (the quantizers' mx forms), which is
// the CPU reference's MXFP8 backward up to the re-blocking's rare underflows; d_y's and d_gu's two
// forms take two passes each.
#include <cuda_runtime.h>

#include <algorithm>

#include "gemm/fp8_quantize.h"
#include "megakernel/fp8_backward_layout.h"
#include "megakernel/layer_impl.h"
#include "megakernel/reverse.h"
#include "schedule/schedule_math.h"

namespace mok {

void Layer::Impl::fp8_backward_weight_codes(cudaStream_t stream) {
  if (e_loc == 0) return;
  const fp8_bwd::WeightsLayout WL = fp8_bwd::weights_layout(e_loc, H, I);
  auto* wb = static_cast<char*>(fp8_bwd_weights.p);
  const auto rule = fp8::ScaleRule::Fp32;
  gemm::quantize_fp8_weights_t(weights.w_down.data, nullptr, e_loc, H, I, rule, wb + WL.q_wd,
                               reinterpret_cast<float*>(wb + WL.s_wd), stream, mx);
  gemm::quantize_fp8_weights_t(weights.w_gate.data, weights.w_up.data, e_loc, I, H, rule, wb + WL.q_w1,
                               reinterpret_cast<float*>(wb + WL.s_w1), stream, mx);
}

// The resident FP8 backward: one window of every routed row, the forward's gate/up rows, x read
// in the x windows. Stage marks as the bf16 backward's (kBwdStageNames): 3 the pulls, 4 the
// weights' codes, d_y's and FC2's dgrad + SwiGLU', 5 d_gu's codes and FC1's dgrad, 6 the router-
// gradient and reverse-dispatch pushes (one kernel), 7 the token blocks and dW_down (with the side
// stream h's token blocks and dW_down run beside FC1's dgrad, in stage 5, or with the pushes beside
// them at EP > 1 in stage 6); dW_gate/up ends at backward()'s mark 8.
void Layer::Impl::backward_resident_fp8(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream) {
  const gpu::ScheduleView v = schedule->view();
  gpu::MoveArgs move = move_args();
  move.sms = sms;  // the pull runs alone here (as in backward_resident; the pushes at EP > 1 beside dW_down)
  Fp8Window w;
  w.rows = cap_rows;
  w.tiles = cap_rows / sched::kBlockM;
  w.tile_expert = v.tile_expert;
  w.row_begin = v.expert_offset;
  w.expert_rows = v.expert_rows;
  w.gu_rows = gu.p;
  w.weight_codes = !config.fp8_keep_weight_codes_t;  // (else made by bind_weights)
  fp8_backward_rows(move, w, dw_gate, dw_up, dw_down, stream, [&](int i) { mark(3 + i, stream); });
}

void Layer::Impl::fp8_backward_rows(const gpu::MoveArgs& move, const Fp8Window& w, void* dw_gate, void* dw_up,
                                    void* dw_down, cudaStream_t stream, const std::function<void(int)>& stage) {
  const gpu::ScheduleView v = schedule->view();
  const SideStream::Joiner joiner(side, stream);  // (a host check that throws after the fork)
  const int64_t rows = w.rows, tiles = w.tiles;
  float* row_w = row_weights.get<float>();
  float* partial = router_partials.get<float>();
  const fp8_bwd::RowsLayout R = fp8_bwd::rows_layout(fp8_bwd_layout_rows(), H, I);
  const fp8_bwd::WeightsLayout WL = fp8_bwd::weights_layout(e_loc, H, I);
  auto* rb = static_cast<char*>(fp8_bwd_rows.p);
  auto* wb = static_cast<char*>(fp8_bwd_weights.p);
  const auto f32 = [](char* p, int64_t off) { return reinterpret_cast<float*>(p + off); };
  if (dy_from_source) {  // d_y's codes and scales as their owners made them (padding rows: a zero row's)
    const fp8_bwd::DoutWindow DW = fp8_bwd::dout_window(sched::pad_rows(shape.max_tokens()), H, true);
    gpu::pull_fp8_rows(move, dout_peers.get<const void* const>(), gpu::Fp8RowsAt{DW.codes, DW.scales, 1.0f},
                       rb + R.q_dy, f32(rb, R.s_dy), stream, weight_peers.get<const float* const>(), row_w);
  } else {
    gpu::pull_reverse_combine(move, dout_peers.get<const void* const>(), weight_peers.get<const float* const>(),
                              dy_routed.p, stream, row_w);
  }
  stage(0);
  const auto rule = fp8::ScaleRule::Fp32;
  const gemm::Options o = gemm_options();
  const gemm::RoutedSegments seg{w.tile_expert, w.row_begin, w.expert_rows, tiles};
  const auto gather = [&](const void* const* peers) {  // routed rows read where they live (whole layout)
    gemm::RowGather g;
    g.peers = peers;
    g.src_rank = v.src_rank;
    g.src_slot = v.src_slot;
    g.top_k = move.top_k;
    g.abort = move.abort;
    return g;
  };
  if (rows > 0 && e_loc > 0) {
    if (w.weight_codes) fp8_backward_weight_codes(stream);
    if (dy_from_source) {  // d_y's token blocks from d_out's rows where they live
      gemm::quantize_fp8_token_blocks_t_gather(gather(dout_peers.get<const void* const>()), rows, H, rb + R.t_dy,
                                               f32(rb, R.ts_dy), stream, seg);
    } else {
      gemm::quantize_fp8_rows_and_token_blocks_t(dy_routed.p, rows, H, rule, rb + R.q_dy, f32(rb, R.s_dy),
                                                 rb + R.t_dy, f32(rb, R.ts_dy), stream, seg, mx);
    }
    gemm::Fp8DgradSwiGLUArgs ds;
    ds.dy = rb + R.q_dy;
    ds.dy_scales = f32(rb, R.s_dy);
    ds.w_down_t = wb + WL.q_wd;
    ds.w_down_t_scales = f32(wb, WL.s_wd);
    ds.gu = w.gu_rows;
    ds.d_gu = w.gu_rows;  // d_gu over the gate/up rows (each tile reads what it writes first)
    ds.hidden = H;
    ds.inter = I;
    ds.experts = e_loc;
    ds.tile_expert = w.tile_expert;
    ds.num_m_tiles = tiles;
    ds.row_weight = row_w;
    ds.router_partial = partial;
    ds.h = h.p;  // the weighted h, dW_down's operand (the forward's h codes are not read)
    gemm::run(gemm::plan_fp8_dgrad_swiglu(ds, o), stream);
  }
  stage(1);
  // dW_down beside FC1's dgrad (side_stream.h): h's token blocks and the wgrad on the side stream,
  // joined before the pushes, or at EP > 1 after them (push_beside: the pushes on those CTAs
  // beside dW_down, which leaves them free; routed_dgrads does the same in bf16). dW_gate/up stays
  // after them: x^T's token blocks are written over the bytes of d_gu's codes, which FC1's dgrad
  // reads.
  const bool beside = rows > 0 && e_loc > 0 && side.on();
  const bool pushes_beside = beside && push_beside;
  gemm::Options wo = o;
  gpu::MoveArgs pm = move;
  if (pushes_beside) {
    wo.max_ctas = sms - config.bwd_comm_sms;  // (as routed_dgrads)
    pm.sms = config.bwd_comm_sms;
  }
  gemm::Fp8WgradArgs w2;
  if (rows > 0 && e_loc > 0) {
    w2.a_t = rb + R.t_dy;
    w2.a_scales = f32(rb, R.ts_dy);
    w2.b_t = rb + R.t_hw;
    w2.b_scales = f32(rb, R.ts_hw);
    w2.dw = dw_down;
    w2.m_out = H;
    w2.n = I;
    w2.experts = e_loc;
    w2.rows_total = rows;
    w2.expert_row_begin = w.row_begin;
    w2.expert_rows = w.expert_rows;
    w2.expert_range = w.owned;
    w2.carry_in = w.carry_in[0];
    w2.carry_out = w.carry_out[0];
    w2.carry_experts = w.carried;
    w2.expert_rows_total = w.rows_total;
  }
  const auto w_down = [&](cudaStream_t ws) {
    gemm::quantize_fp8_token_blocks_t(h.p, rows, I, rb + R.t_hw, f32(rb, R.ts_hw), ws, seg, mx);
    gemm::run(gemm::plan_fp8_wgrad(w2, wo), ws);
  };
  if (beside) {
    side.fork(stream);
    w_down(side.target(stream));
  }
  if (rows > 0 && e_loc > 0) {
    gemm::quantize_fp8_rows_and_token_blocks_t(w.gu_rows, rows, 2 * I, rule, rb + R.q_dgu, f32(rb, R.s_dgu),
                                               rb + R.t_dgu, f32(rb, R.ts_dgu), stream, seg, mx);
    gemm::Fp8GroupedArgs dx;
    dx.a = rb + R.q_dgu;
    dx.a_scales = f32(rb, R.s_dgu);
    dx.w = wb + WL.q_w1;
    dx.w_scales = f32(wb, WL.s_w1);
    dx.y = y.p;
    dx.k = 2 * I;
    dx.n = H;
    dx.experts = e_loc;
    dx.tile_expert = w.tile_expert;
    dx.num_m_tiles = tiles;
    const gemm::Options o1 = options_as(w.width_tiles, H);
    gemm::run(dx_scatter ? gemm::plan_fp8_grouped_scatter(dx, row_scatter(move), o1) : gemm::plan_fp8_grouped(dx, o1),
              stream);
  }
  if (!pushes_beside) side.join(stream);
  stage(2);
  // Both pushes in one kernel: the router-weight gradient's sums and the d_x rows (reverse dispatch;
  // FC1's dgrad stored them in their slots with dx_scatter).
  gpu::push_router_grad(pm, partial, gemm::router_parts(I), dweight_peers.get<float* const>(), stream,
                        dx_scatter ? nullptr : y.p, dx_scatter ? nullptr : combine_peers.get<void* const>());
  side.join(stream);
  stage(3);
  if (rows == 0 || e_loc == 0) {  // no rows: zero gradients
    for (void* p : {dw_gate, dw_up, dw_down})
      MOK_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(e_loc * I * H) * 2, stream));
    stage(4);
    return;
  }
  // The wgrads' other operands (h's: in w_down); x^T over the bytes of [d_g d_u]'s rows (FC1's
  // dgrad has read them).
  if (w.x_rows != nullptr) {
    gemm::quantize_fp8_token_blocks_t(w.x_rows, rows, H, rb + R.t_x, f32(rb, R.ts_x), stream, seg, mx);
  } else {
    gemm::quantize_fp8_token_blocks_t_gather(gather(x_peers.get<const void* const>()), rows, H, rb + R.t_x,
                                             f32(rb, R.ts_x), stream, seg, mx);
  }
  if (!beside) w_down(stream);
  stage(4);
  gemm::Fp8WgradArgs w1 = w2;
  w1.a_t = rb + R.t_dgu;
  w1.a_scales = f32(rb, R.ts_dgu);
  w1.b_t = rb + R.t_x;
  w1.b_scales = f32(rb, R.ts_x);
  w1.dw = dw_gate;
  w1.dw_up = dw_up;
  w1.m_out = 2 * I;
  w1.n = H;
  w1.carry_in = w.carry_in[1];
  w1.carry_out = w.carry_out[1];
  gemm::run(gemm::plan_fp8_wgrad(w1, o), stream);
}

}  // namespace mok
