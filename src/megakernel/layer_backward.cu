// The GPU layer's backward (unfused kernels; a backward megakernel will mirror the forward) and
// the helpers it shares with the shared expert's backward (its stage profile: layer_profile.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <string>

#include "common/device_check.h"
#include "common/env_flag.h"
#include "gemm/fp8_quantize.h"
#include "megakernel/backward_program.h"
#include "megakernel/fp8_backward_layout.h"
#include "megakernel/layer_impl.h"
#include "megakernel/merge.h"
#include "megakernel/reverse.h"
#include "mok/memory.hpp"
#include "schedule/schedule_math.h"

namespace mok {

using layer_detail::upload_array;

// ---------------------------------------------------------------------------------------------
// Backward (unfused). Buffers it reuses from the forward: gu (d_gu is written over it; FC2's dgrad
// computes h from it and writes the weighted h, dW_down's operand, into h), the routed x rows (for
// dW_gate, dW_up), y (the routed d_x rows), the shared expert's gu_s, h_s (read: its dgrad has no
// row weights) and y_s, and the combine window (the reverse-dispatch slots; the forward's
// y rows there are not read: the router-weight gradient is <d_out . W_down, h>, from FC2's
// dgrad). Its own: dy_routed, the row weights and the router gradient's partial sums.
void Layer::Impl::backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& g, cudaStream_t stream,
                           int64_t forward_id) {
  const layer_detail::CallScope scope(comm, stream, "backward()");
  // FP8 / MXFP8 train on the unfused path (layer_fp8_backward.cu, resident) and on the megakernel
  // over windows of a ring below the worst case (FC1 again for every window).
  const char* prec = to_string(config.precision);
  MOK_REQUIRE(!fp8 || !fused || windowed, "config.forward_path",
              "must be unfused for a backward with config.precision ", prec,
              ", or the megakernel's ring below the worst case (config.workspace_budget_bytes, "
              "macrobatch_tokens: the backward over windows); the FP8 megakernel with a resident ring is forward "
              "only so far");
  MOK_REQUIRE(!fp8 || config.backward_path == BackwardPath::Unfused, "config.backward_path",
              "must be unfused with config.precision ", prec, " (the backward's GEMM program is bf16 only so far)");
  // Which forward: the last one, or one whose state a slot still holds (Config::saved_forwards).
  MOK_REQUIRE(forward_id >= -1, "backward.forward_id", "must be a forward's number or -1 (the last), got ",
              forward_id);
  const int64_t id = forward_id < 0 ? forwards - 1 : forward_id;
  const int64_t n = static_cast<int64_t>(std::max<size_t>(slots.size(), 1));
  MOK_REQUIRE(id >= 0 && id < forwards && id >= forwards - n, "backward.forward_id",
              "the layer holds the saved state of forwards ", std::max<int64_t>(0, forwards - n), " to ", forwards - 1,
              " (config.saved_forwards = ", n, "), got forward ", id);
  refuse_capture_with_slots(stream);
  if (slots.size() > 1) activate(static_cast<int>(id % n));
  MOK_REQUIRE(active_generation == id, "backward.forward_id", "forward ", id, "'s state was overwritten");
  check_routing(in);
  validate_grad_output_layout(shape, rank, d_out);
  validate_grads_layout(shape, rank, g);
  MOK_REQUIRE(!g.accumulate || !fp8, "grads.accumulate", "not with config.precision ", prec,
              " (the FP8 weight gradients are written as bf16 so far)");
  MOK_REQUIRE(!g.accumulate || config.backward_path == BackwardPath::Unfused, "grads.accumulate",
              "needs config.backward_path unfused (the backward's GEMM program writes bf16 gradients)");
  bwd_accumulate = g.accumulate;
  bool shared_done = false;  // (the shared expert's backward ran during the windows' first pulls)
  const int dev = comm.device();
  check_device_tensor("d_out", d_out, dev);
  check_device_tensor("grads.d_x", g.d_x, dev);
  check_device_tensor("grads.d_topk_w", g.d_topk_w, dev, 4);
  check_device_weight_set("grads.d_w", g.d_w_gate, g.d_w_up, g.d_w_down, g.d_ws_gate, g.d_ws_up, g.d_ws_down, Is > 0,
                          dev);
  MOK_REQUIRE((!x_window_shared && slots.size() <= 1 && !fp8 && !(x_from_caller && windowed)) || T == 0 ||
                  in.x.data != win_x->ptr,
              "x",
              "with config.share_workspace, config.saved_forwards > 1, config.precision fp8 / mxfp8, or over windows "
              "after a forward that read x in place, backward() reads x from the caller's tensor: input_buffer() "
              "holds the last forward's x (of any layer, with a shared workspace; in FP8 its E4M3 codes)");
  MOK_REQUIRE(saved, "forward(save_for_backward)",
              "backward() needs the last forward() to have saved the gate/up pre-activations "
              "(save_for_backward = true), and runs once per forward (it overwrites them with d_gu "
              "and the combine slots with d_x rows)");
  // Output pointers (the refs' data are const views).
  void* d_x = const_cast<void*>(g.d_x.data);
  float* d_topk_w = static_cast<float*>(const_cast<void*>(g.d_topk_w.data));
  void* dw_gate = const_cast<void*>(g.d_w_gate.data);
  void* dw_up = const_cast<void*>(g.d_w_up.data);
  void* dw_down = const_cast<void*>(g.d_w_down.data);
  const bool at_source = fp8 && fp8_bwd::dy_at_source(shape, config);
  dy_from_source = at_source && !fp8_bwd::dy_routed_copy_for_testing().load();
  // (Before any collective step: the routed copy's buffer is made by the layer's first backward.)
  MOK_REQUIRE(!at_source || dy_from_source || dy_routed.p != nullptr || row_weights.p == nullptr,
              "fp8_bwd::dy_routed_copy_for_testing",
              "set before the layer's first backward (the routed d_y copy is allocated then)");
  allocate_backward();
  // Stage events only outside stream capture: a plain record adds no node to a graph.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  marking = capturing == cudaStreamCaptureStatusNone;
  bwd_marked = false;
  saved = false;  // gu becomes d_gu and the combine slots d_x rows: one backward per forward
  mark(0, stream);
  if (T > 0) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(win_dout->ptr, d_out.data, static_cast<size_t>(T * H) * 2,
                                   cudaMemcpyDeviceToDevice, stream));
    // FP8 (recipe 1): d_y's 1 x 128 codes made here, once per token, for the peers to pull.
    if (dy_from_source) {
      const fp8_bwd::DoutWindow DW = fp8_bwd::dout_window(sched::pad_rows(shape.max_tokens()), H, true);
      MOK_REQUIRE(static_cast<int64_t>(win_dout->bytes) >= DW.bytes, "window.d_out",
                  "holds the d_out codes (", DW.bytes, " bytes), got ", win_dout->bytes);
      char* w = static_cast<char*>(win_dout->ptr);
      gemm::quantize_fp8_blocked(w, T, H, 1, fp8::ScaleRule::Fp32, w + DW.codes, reinterpret_cast<float*>(w + DW.scales),
                                 stream);
    }
    // A shared x window holds the last forward's x of any layer, and with several forwards alive
    // ours holds the last one's: this forward's again (the windows' re-pull and the shared expert
    // read it).
    // In FP8 / MXFP8 the window holds x's codes: the backward reads the bf16 rows (x^T's token blocks).
    // Over windows the x rows are pulled again from the window, which a forward that read the
    // caller's x did not fill (the resident backward does not read it: no shared expert there).
    if (x_window_shared || slots.size() > 1 || fp8 || (x_from_caller && windowed))
      MOK_CUDA_CHECK(cudaMemcpyAsync(win_x->ptr, in.x.data, static_cast<size_t>(T * H) * 2,
                                     cudaMemcpyDeviceToDevice, stream));
    // The router weights the peers read for the reverse combine: the caller's, checked again
    // (and its routing compared with the forward's), 0 for the forward's empty slots.
    gpu::check_backward_routing(in.topk_idx.data, in.topk_idx.dtype == DType::I64,
                                static_cast<const float*>(in.topk_w.data), T, k, shape.experts, rank, backward_routing(),
                                static_cast<float*>(win_weights->ptr), errors.device(), stream);
  }
  // This backward's forward and layer, for the peers to compare (the call words after our weights).
  void* call_word = static_cast<char*>(win_weights->ptr) + router_call_offset(shape.max_tokens(), k);
  gpu::publish_call_id(call_word, id, layer_number, stream);
  mark(1, stream);
  barrier(stream);  // d_out, x and weights visible, and every rank's forward id
  gpu::check_call_ids(call_peers.get<const void* const>(), world, id, layer_number, rank, errors.device(), dc.claim,
                      stream);
  mark(2, stream);
  if (windowed) {
    // (Pulling ahead, the shared expert's backward runs while the lane pulls the first window: it
    // reads only this rank's rows.)
    shared_done = backward_windows(dw_gate, dw_up, dw_down, stream, [&] {
      if (Is > 0 && T > 0) shared_backward(g, stream);
    });  // one stage in the profile: marks 3-7 follow it
    for (int i = 3; i <= 7; ++i) mark(i, stream);
  } else if (fp8) {
    backward_resident_fp8(dw_gate, dw_up, dw_down, stream);
  } else {
    backward_resident(dw_gate, dw_up, dw_down, stream);
  }
  mark(8, stream);
  barrier(stream);  // every d_x row pushed into our slots and every router-weight gradient landed
  mark(9, stream);
  bwd_marked = marking && !bwd_marks.empty();
  gpu::finish_router_grad(static_cast<const float*>(win_dweights->ptr), backward_routing(), T * k, dc.claim, d_topk_w,
                          stream);
  if (T == 0) {  // no tokens: the shared expert's gradient over them is zero
    for (const TensorRef* p : {&g.d_ws_gate, &g.d_ws_up, &g.d_ws_down})
      if (Is > 0) MOK_CUDA_CHECK(cudaMemsetAsync(const_cast<void*>(p->data), 0, static_cast<size_t>(Is * H) * 2, stream));
    mark(10, stream);
    mark(11, stream);
    return;
  }
  if (Is > 0 && !shared_done) shared_backward(g, stream);
  mark(10, stream);
  gpu::MergeArgs m;
  m.shared = Is > 0 ? y_s.p : nullptr;
  m.slots = win_combine->ptr;
  m.topk_idx = backward_routing();
  m.abort = dc.claim;
  m.tokens = T;
  m.top_k = k;
  m.hidden = H;
  m.out = d_x;
  gpu::merge_backward(m, stream);
  mark(11, stream);
}

// Every routed row of the forward resident (the unfused path, or a ring of the worst case): each
// stage once over all rows, the forward's gu and x rows read as they are (h: from gu in FC2's dgrad).
void Layer::Impl::backward_resident(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream) {
  const gpu::ScheduleView v = schedule->view();
  const int64_t tiles = cap_rows / sched::kBlockM;
  // The pull runs alone here: every SM (the push too at EP 1; at EP > 1 it runs beside the weight
  // gradients on bwd_comm_sms CTAs: routed_dgrads). With the forward's comm SM count (8 at
  // DeepSeek-V3) the pull took 5.9 ms and the push 3.2 ms of a 31 ms backward (MOK_PROFILE, 2 H200s,
  // T = 8192, before the movers were rewritten): ~160 and ~290 GB/s for 0.94 GB each.
  gpu::MoveArgs move = move_args();
  move.sms = sms;
  // Weight gradients: rows in the schedule's order, padding rows masked.
  gemm::WgradArgs wd = wgrad_args(dy_routed.p, h.p, dw_down, H, I, e_loc, cap_rows, v.expert_offset, v.expert_rows);
  gemm::WgradArgs w1 =
      wgrad_args(gu.p, x_rows, dw_gate, 2 * I, H, e_loc, cap_rows, v.expert_offset, v.expert_rows, dw_up);
  wd.accumulate = w1.accumulate = bwd_accumulate;  // GradRefs::accumulate (not on the program's path)
  const bool program = config.backward_path == BackwardPath::Fused && cap_rows > 0;
  // The weight gradients beside FC1's dgrad, on the side stream forked after FC2's dgrad
  // (side_stream.h; MOK_BWD_STREAMS=0: after the pushes, as before). With the fork their stages'
  // time is in "FC1 dgrad", with the pushes beside them (EP > 1) in the push's stage.
  const auto wgrads = [&](cudaStream_t ws, const gemm::Options& wo) {
    gemm::run(gemm::plan_wgrad(wd, wo), ws);
    if (ws == stream) mark(7, stream);
    gemm::run(gemm::plan_wgrad(w1, wo), ws);
  };
  const bool beside = !program && cap_rows > 0;
  routed_dgrads(move, gu.p, v.tile_expert, tiles, 0, stream, true, program ? &wd : nullptr, program ? &w1 : nullptr,
                false, beside ? Beside(wgrads) : nullptr);
  if (program) {
    mark(7, stream);  // the weight gradients ran in the program (the stage "FC2 dgrad" holds it all)
  } else if (cap_rows > 0) {
    if (side.on()) mark(7, stream);
  } else {  // no rank has tokens: no rows, zero gradients (nothing to add with accumulate)
    if (!bwd_accumulate)
      for (void* p : {dw_gate, dw_up, dw_down})
        MOK_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(e_loc * I * H) * 2, stream));
    mark(7, stream);
  }
}

// The shared expert over this rank's tokens: dy = d_out (weight 1), as one expert of T rows. Its
// weight gradients beside its FC1 dgrad (the side stream, as the routed experts': side_stream.h).
void Layer::Impl::shared_backward(const DeviceGrads& g, cudaStream_t stream) {
  const int32_t* begin = shared_rows.get<const int32_t>();
  const SideStream::Joiner joiner(side, stream);
  run_dgrads(win_dout->ptr, weights.ws_down.data, gu_s.p, weights.ws_gate.data, weights.ws_up.data, y_s.p, Is, 1,
             shared_tiles.get<const int32_t>(), t_tiles, stream, -1, 0, nullptr, nullptr, nullptr, &side);
  const cudaStream_t ws = side.target(stream);
  run_wgrad(win_dout->ptr, h_s.p, const_cast<void*>(g.d_ws_down.data), H, Is, 1, t_tiles * sched::kBlockM, begin, begin + 1, ws);
  run_wgrad(gu_s.p, win_x->ptr, const_cast<void*>(g.d_ws_gate.data), 2 * Is, H, 1, t_tiles * sched::kBlockM, begin,
            begin + 1, ws, const_cast<void*>(g.d_ws_up.data));
  side.join(stream);
}

void Layer::Impl::pull_dy_rows(const gpu::MoveArgs& move, cudaStream_t stream, void* x_to) {
  gpu::pull_reverse_combine(move, dout_peers.get<const void* const>(), weight_peers.get<const float* const>(),
                            dy_routed.p, stream, row_weights.get<float>(),
                            x_to != nullptr ? x_peers.get<const void* const>() : nullptr, x_to);
}

// The routed rows of move's window, their x rows, gate/up rows (gu_rows) and h (written): the
// unweighted d_out rows pulled with their router weights (reverse combine; `pulled`: the caller
// did, pull_dy_rows), FC2's dgrad + SwiGLU' (d_gu over gu_rows, the router-weight gradient's
// partial sums, the weighted h from gu: dW_down's operand), FC1's dgrad into y, then one kernel
// pushes the partial sums to the source ranks and the d_x rows into their source slots (reverse
// dispatch). marks: the resident backward's stage marks.
// wd, w1 (Config::backward_path fused): the window's weight gradients, which then run with the
// dgrads in one kernel (the backward's GEMM program) before the pushes. beside (the unfused
// weight gradients): enqueued on the stream it is given, the side stream forked after FC2's
// dgrad and joined before the pushes (side_stream.h), after them where they run beside it (EP >
// 1, push_beside; or on the lane when pulling ahead, push_on_lane), or the caller's after the
// pushes without a side stream. pull (x_beside): rows FC2's dgrad's idle producer warps copy
// beside its MMAs (the window's x rows, which only the weight gradients read).
void Layer::Impl::routed_dgrads(const gpu::MoveArgs& move, void* gu_rows, const int32_t* tile_expert, int64_t tiles,
                                int64_t width_tiles, cudaStream_t stream, bool marks, const gemm::WgradArgs* wd,
                                const gemm::WgradArgs* w1, bool pulled,
                                const Beside& beside, const gemm::RowPull* pull) {
  MOK_REQUIRE(beside == nullptr || wd == nullptr, "routed_dgrads", "takes the program's weight gradients or beside's");
  MOK_REQUIRE(pull == nullptr || wd == nullptr, "routed_dgrads", "pulls rows beside FC2's dgrad kernel, not the program");
  const SideStream::Joiner joiner(side, stream);  // (a host check that throws after the fork)
  float* row_w = row_weights.get<float>();
  float* partial = router_partials.get<float>();
  if (!pulled) pull_dy_rows(move, stream);
  if (marks) mark(3, stream);
  gemm::RowScatter scatter;  // (FC1's dgrad outside the program: the reverse dispatch in its epilogue)
  if (wd != nullptr && w1 != nullptr) {
    gemm::DgradSwiGLUArgs ds;
    gemm::DgradArgs dx;
    dgrad_args(dy_routed.p, weights.w_down.data, gu_rows, weights.w_gate.data, weights.w_up.data, y.p, I, e_loc,
               tile_expert, tiles, row_w, partial, h.p, ds, dx);
    run_backward_program(ds, dx, *wd, *w1, stream);
    if (marks) mark(4, stream);
  } else {
    if (dx_scatter) scatter = row_scatter(move);  // the d_x rows into their slots from FC1's dgrad
    run_dgrads(dy_routed.p, weights.w_down.data, gu_rows, weights.w_gate.data, weights.w_up.data, y.p, I, e_loc,
               tile_expert, tiles, stream, marks ? 4 : -1, width_tiles, row_w, partial, h.p,
               beside && side.on() ? &side : nullptr, dx_scatter ? &scatter : nullptr, pull);
  }
  // The side's work beside FC1's dgrad. At EP 1 it is joined before the pushes: pushed last,
  // their kernel gets every SM at once (behind persistent GEMMs its CTAs would start staggered and
  // delay the next GEMM's: measured +2% on the resident backward when the weight gradients
  // followed them). With push_beside (EP > 1: the d_x rows go over NVLink) the weight
  // gradients run on the other SMs and the pushes on those, beside them, then the join. Pulling
  // ahead (push_on_lane, layer_backward_windows.cu) the pushes go on the lane before the next
  // window's pulls, so that the lane never takes more than its CTAs' SMs; the caller's stream
  // waits for them through the next window's d_out rows (or the lane's join after the last).
  const bool lane_push = beside && side.on() && push_on_lane;
  const bool pushes_beside = beside && side.on() && push_beside && !lane_push;
  gpu::MoveArgs pm = move;
  const bool scattered = scatter.to != nullptr;
  const auto push = [&](cudaStream_t s) {  // both pushes in one kernel: the router-weight
    // gradient's sums and the d_x rows (reverse dispatch; FC1's dgrad stored them if scattered)
    gpu::push_router_grad(pm, partial, gemm::router_parts(I), dweight_peers.get<float* const>(), s,
                          scattered ? nullptr : y.p, scattered ? nullptr : combine_peers.get<void* const>());
  };
  if (beside && side.on()) {
    gemm::Options wo = gemm_options();
    wo.max_ctas = bwd_gemm_ctas;
    if (pushes_beside || lane_push) {
      wo.max_ctas = sms - config.bwd_comm_sms;
      pm.sms = config.bwd_comm_sms;
    }
    if (lane_push) {
      d1_done.record(stream);
      d1_done.wait(lane.target(stream));
      push(lane.target(stream));
    }
    beside(side.target(stream), wo);
    if (!pushes_beside) side.join(stream);
  }
  if (marks) mark(5, stream);
  if (!lane_push) push(stream);
  if (pushes_beside) side.join(stream);
  if (marks) mark(6, stream);
  if (beside && !side.on()) beside(stream, gemm_options());
}

// FC1's dgrad's rows of move's window into their slots of the owners' combine windows, where the
// reverse dispatch's push would copy them (gemm::RowScatter; dx_scatter).
gemm::RowScatter Layer::Impl::row_scatter(const gpu::MoveArgs& move) const {
  gemm::RowScatter s;
  s.src_rank = move.schedule.src_rank;
  s.src_slot = move.schedule.src_slot;
  s.to = combine_peers.get<void* const>();
  s.row_base = move.row_begin;
  s.abort = move.abort;
  return s;
}

gemm::RowPull Layer::Impl::x_pull(const gpu::MoveArgs& move) const {
  static_assert(offsetof(gpu::ScheduleTotals, total_rows) == 0, "RowPull::total_rows points at the totals");
  gemm::RowPull g;
  g.src_rank = move.schedule.src_rank;
  g.src_slot = move.schedule.src_slot;
  g.total_rows = reinterpret_cast<const int32_t*>(move.schedule.totals);
  g.from = x_peers.get<const void* const>();
  g.to = x_rows;
  g.row_begin = move.row_begin;
  g.row_end = move.row_end;
  g.n = H;
  g.top_k = k;
  g.abort = move.abort;
  return g;
}

// the d_x rows = rnd(d_gu . [w_gate; w_up]) into dx_rows; mark_between >= 0 records that stage mark
// between, and fork_after_d2 forks there (the weight gradients go to its target()). row_weight /
// router_partial / h_rows: unweighted dy rows (gemm::DgradSwiGLUArgs).
void Layer::Impl::run_dgrads(const void* dy, const void* w_down, void* gu_buf, const void* w_gate, const void* w_up,
                             void* dx_rows, int64_t inter, int64_t experts, const int32_t* tile_expert, int64_t tiles,
                             cudaStream_t stream, int mark_between, int64_t width_tiles, const float* row_weight,
                             float* router_partial, void* h_rows, SideStream* fork_after_d2,
                             const gemm::RowScatter* scatter, const gemm::RowPull* pull) {
  gemm::DgradSwiGLUArgs ds;
  gemm::DgradArgs dx;
  dgrad_args(dy, w_down, gu_buf, w_gate, w_up, dx_rows, inter, experts, tile_expert, tiles, row_weight, router_partial,
             h_rows, ds, dx);
  if (pull != nullptr) ds.pull = *pull;
  gemm::run(gemm::plan_dgrad_swiglu(ds, options_as(width_tiles, inter)), stream);
  if (mark_between >= 0) mark(mark_between, stream);
  if (fork_after_d2 != nullptr) fork_after_d2->fork(stream);
  const gemm::Options o1 = options_as(width_tiles, H);
  gemm::run(scatter != nullptr ? gemm::plan_dgrad_scatter(dx, *scatter, o1) : gemm::plan_dgrad(dx, o1), stream);
}

void Layer::Impl::dgrad_args(const void* dy, const void* w_down, void* gu_buf, const void* w_gate, const void* w_up,
                             void* dx_rows, int64_t inter, int64_t experts, const int32_t* tile_expert, int64_t tiles,
                             const float* row_weight, float* router_partial, void* h_rows, gemm::DgradSwiGLUArgs& ds,
                             gemm::DgradArgs& dx) const {
  ds.row_weight = row_weight;
  ds.router_partial = router_partial;
  ds.h = h_rows;
  ds.dy = dy;
  ds.w_down = w_down;
  ds.gu = gu_buf;
  ds.d_gu = gu_buf;
  ds.hidden = H;
  ds.inter = inter;
  ds.experts = experts;
  ds.tile_expert = tile_expert;
  ds.num_m_tiles = tiles;
  dx.dy = gu_buf;
  dx.w = w_gate;
  dx.w_up = w_up;
  dx.dx = dx_rows;
  dx.k = 2 * inter;
  dx.n = H;
  dx.experts = experts;
  dx.tile_expert = tile_expert;
  dx.num_m_tiles = tiles;
}

// The window's four GEMMs as one kernel (mk::launch_backward_program): their plans at the
// program's tile shape (256 wide, no clusters), the ticket and dependency counters zeroed first.
void Layer::Impl::run_backward_program(const gemm::DgradSwiGLUArgs& ds, const gemm::DgradArgs& dx,
                                       const gemm::WgradArgs& wd, const gemm::WgradArgs& w1, cudaStream_t stream) {
  MOK_REQUIRE(ds.pull.to == nullptr, "backward program", "pulls no rows beside its GEMMs");
  MOK_REQUIRE(wd.expert_row_begin == w1.expert_row_begin && wd.expert_rows == w1.expert_rows &&
                  wd.expert_range == w1.expert_range,
              "backward program", "both weight gradients run over the same experts' rows");
  gemm::Options o = gemm_options();
  o.block_n = 256;
  o.cluster = false;
  mk::BwdProgramParams p;
  p.d2 = mk::bwd_gemm_of(gemm::plan_dgrad_swiglu(ds, o), "backward program (FC2 dgrad)");
  p.d1 = mk::bwd_gemm_of(gemm::plan_dgrad(dx, o), "backward program (FC1 dgrad)");
  p.wd = mk::bwd_gemm_of(gemm::plan_wgrad(wd, o), "backward program (wgrad down)");
  p.w1 = mk::bwd_gemm_of(gemm::plan_wgrad(w1, o), "backward program (wgrad gate/up)");
  p.counters = bwd_counters.get<uint32_t>();
  p.merge = bwd_merge;
  const int64_t words = mk::bwd_program_counter_words(ds.num_m_tiles);
  MOK_REQUIRE(words * 4 <= mem.bytes("bwd_counters"), "backward program", "its counters fit the planned buffer (",
              mem.bytes("bwd_counters"), " bytes), need ", words * 4);
  MOK_CUDA_CHECK(cudaMemsetAsync(p.counters, 0, static_cast<size_t>(words) * 4, stream));
  mk::launch_backward_program(p, dc, sms, stream);
}

// The environment's experiment knobs (MOK_PROFILE, the backward's; the same bits either way).
void Layer::Impl::read_knobs() {
  const char* prof = std::getenv("MOK_PROFILE");
  profile = prof != nullptr && std::string(prof) == "1";
  // The backward program's ticket order (an experiment knob, the same bits either way).
  if (const char* order = std::getenv("MOK_BWD_ORDER")) {
    const std::string o = order;
    MOK_REQUIRE(o == "phased" || o == "merged" || o == "static", "MOK_BWD_ORDER",
                "must be 'phased', 'merged' or 'static', got '", o, "'");
    bwd_merge = o == "merged" ? 1 : o == "static" ? 2 : 0;
  }
  // The windows' held rows (layer_backward_windows.cu; an experiment knob, the same bits either
  // way): MOK_BWD_HOLD=0 carries every cut expert's sums instead.
  bwd_hold = env_flag("MOK_BWD_HOLD", true);
  // The windows past the routed rows skipped after a host wait for the row count (1), or the wait
  // alone (2, the control): a measurement knob that prices the empty windows
  // (layer_backward_windows.cu; the same bits either way).
  sync_windows = 0;
  if (const char* sw = std::getenv("MOK_BWD_SYNC_WINDOWS")) {
    const std::string v = sw;
    MOK_REQUIRE(v == "0" || v == "1" || v == "2", "MOK_BWD_SYNC_WINDOWS", "must be 0, 1 or 2, got '", v, "'");
    sync_windows = v[0] - '0';
  }
  // The backward's M-grouped GEMMs (the dgrads, full recompute's FC1) split their raster
  // groups where the expert changes (gemm::Options::group_experts; the same tiles and bits in
  // another order): at DeepSeek-V3 EP 1 FC1's dgrad read 20.0 -> 17.2 GB and took 7.55 -> 6.85 ms
  // (ncu), the layer's backward 0.98x (one H100, bench/results/group-experts-ab-h100x1.json).
  // The FP8 dgrads gained 1-2% in the GEMM bench at 256 and 260 rows per expert. MOK_GROUP_EXPERTS=0
  // turns it off. Not the megakernels or the fused backward program: they order their own tickets.
  group_experts = env_flag("MOK_GROUP_EXPERTS", true);
}

gemm::Options Layer::Impl::options_as(int64_t width_tiles, int64_t n) const {
  gemm::Options o = gemm_options();
  o.group_experts = group_experts;  // (the backward's M-grouped forms; read_knobs)
  if (width_tiles > 0) o.block_n = gemm::choose_block_n(width_tiles, n, sms);
  o.max_ctas = bwd_gemm_ctas;  // (the tile width is chosen for every SM either way: the same tiles)
  return o;
}

void Layer::Impl::run_wgrad(const void* a, const void* b, void* dw, int64_t m, int64_t n, int64_t experts,
                            int64_t rows_total, const int32_t* row_begin, const int32_t* rows, cudaStream_t stream,
                            void* dw_up) const {
  gemm::run(gemm::plan_wgrad(wgrad_args(a, b, dw, m, n, experts, rows_total, row_begin, rows, dw_up),
                             options_as(0, n)),  // (bwd_gemm_ctas: beside the lane's pulls)
            stream);
}

// dw_up: a is packed gate/up (d_gu), dw gets the gate rows and dw_up the up rows.
gemm::WgradArgs Layer::Impl::wgrad_args(const void* a, const void* b, void* dw, int64_t m, int64_t n, int64_t experts,
                                        int64_t rows_total, const int32_t* row_begin, const int32_t* rows, void* dw_up,
                                        const float* carry_in, float* carry_out, const int32_t* carry_experts,
                                        const int32_t* expert_rows_total, const int32_t* expert_range) const {
  gemm::WgradArgs w;
  w.a = a;
  w.b = b;
  w.dw = dw;
  w.m = m;
  w.n = n;
  w.experts = experts;
  w.rows_total = rows_total;
  w.expert_row_begin = row_begin;
  w.expert_rows = rows;
  w.dw_up = dw_up;
  w.carry_in = carry_in;
  w.carry_out = carry_out;
  w.carry_experts = carry_experts;
  w.expert_rows_total = expert_rows_total;
  w.expert_range = expert_range;
  return w;
}

void Layer::Impl::allocate_backward() {
  if (row_weights.p != nullptr) return;
  side.create(comm.device());  // (the first backward: not under stream capture)
  // The pushes beside the weight gradients where they cross NVLink (routed_dgrads).
  push_beside = env_flag("MOK_BWD_PUSH_BESIDE", world > 1) && side.on();
  // The reverse dispatch in FC1's dgrad epilogue (gemm::plan_dgrad_scatter; the same bits): the
  // d_x rows go straight to their slots instead of through dense rows and a push kernel, which
  // at DeepSeek-V3 EP 1 read and wrote 0.94 GB each (0.74 ms under ncu). Measured on one H100
  // (bench/results/dx-scatter-*ab-h100x1.json): the backward 0.983x at DeepSeek-V3 and Qwen3-235B,
  // 0.992x in FP8. On by default at EP 1; at EP > 1 its stores would cross NVLink from the GEMM's
  // consumer warps instead of the pushes' comm SMs beside the weight gradients, not yet measured:
  // MOK_DX_SCATTER=1 there (=0 turns it off anywhere).
  dx_scatter = env_flag("MOK_DX_SCATTER", world == 1);
  // A window's x rows (only dW_gate/up reads them, on the side stream after FC2's dgrad) copied by
  // FC2's dgrad's idle producer warps beside its MMAs (gemm::RowPull), instead of with the d_out
  // rows before it: the copy leaves the critical path if it ends before the MMAs do (at EP 1 a
  // local copy of T k rows, ~0.18 ms of Qwen3-30B-A3B's 3.1 ms backward, ~0.35 of Qwen3-235B's
  // 11; three warps an SM keep only ~3 KB in flight, with the next row prefetched into L2, so at
  // small I, where the dgrad is short, it may not). Windows inside the activation budget, bf16,
  // four GEMM kernels, not pulling ahead. An experiment until measured: MOK_BWD_X_BESIDE=1.
  x_beside = env_flag("MOK_BWD_X_BESIDE", false) && windowed && !fp8 && config.backward_path == BackwardPath::Unfused;
  pull_ahead = env_flag("MOK_BWD_PULL_AHEAD", world > 1) && windowed && !fp8 && config.backward_path == BackwardPath::Unfused && side.on();
  if (pull_ahead) {
    lane.create(comm.device());
    for (StreamMark* m : {&dy_pulled, &x_pulled, &dy_read, &x_read, &d1_done}) m->create(comm.device());
  }
  if (profile && bwd_marks.empty()) {
    for (int i = 0; i <= kBwdStages; ++i) {
      cudaEvent_t e = nullptr;
      MOK_CUDA_CHECK(cudaEventCreate(&e));
      bwd_marks.push_back(e);
    }
  }
  if (mem.has("dy_rows"))
    dy_routed = allocate("dy_rows", "backward dy rows");
  else if (fp8_bwd::dy_routed_copy_for_testing().load())  // (FP8 d_y at its source needs none)
    dy_routed = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(cap_rows, sched::kBlockM) * H * 2), "backward dy rows");
  row_weights = allocate("row_weights", "backward row weights");
  router_partials = allocate("router_partials", "backward router gradient partial sums");
  if (config.backward_path == BackwardPath::Fused)
    bwd_counters = allocate("bwd_counters", "backward program counters");
  if (fp8) {
    fp8_bwd_rows = allocate("fp8_bwd_rows", "fp8 backward row codes");
    if (!fp8_bwd_weights.p) fp8_bwd_weights = allocate("fp8_bwd_weights", "fp8 backward weight codes");
  }
  if (windowed) {
    bwd_carry = allocate("bwd_carry", "backward wgrad carries");
    bwd_windows = allocate("bwd_windows", "backward window parts");
  }
  // The zeroing (cudaMemset, the legacy stream) done before the call's stream uses them.
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  if (Is > 0 && T > 0) {
    // The shared expert as one expert of T rows starting at row 0: {begin, rows}.
    shared_rows = upload_array(std::vector<int32_t>{0, static_cast<int32_t>(T)}, "shared expert rows");
    if (shared_tiles.p == nullptr)  // the megakernel path has no shared tile table
      shared_tiles = upload_array(std::vector<int32_t>(static_cast<size_t>(t_tiles), 0), "shared tiles");
  }
}

}  // namespace mok
