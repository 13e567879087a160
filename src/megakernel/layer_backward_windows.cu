// The GPU layer's backward over windows of the routed rows: the megakernel's ring holds fewer rows
// than the worst case, so the forward kept only the gate/up rows of the activation budget (and no
// routed x rows): notes/memory.md. Bitwise the unfused backward (tests/gpu/megakernel/
// test_layer_memory.cu, LayerBackwardWindows: uniform, Zipf, one-expert routing; budgets of
// everything, half, nothing).
#include <cuda_runtime.h>

#include <algorithm>

#include "megakernel/layer_impl.h"
#include "megakernel/reverse.h"
#include "mok/gemm_sizes.hpp"
#include "schedule/schedule_math.h"

namespace mok {

// Window by window (R = the ring's rows, a fixed count of windows covering the worst case: those
// past the routed rows move and compute nothing, their tiles being -1 and their parts empty, so
// the host never waits for the row count; the activation budget's end, when inside a window, cuts
// it in two): the x rows pulled again into the ring with the d_out rows (one kernel; with
// MOK_BWD_X_BESIDE a saved window's x rows by FC2's dgrad's idle producer warps instead); for a
// window inside the budget the saved gate/up rows, past it FC1 run again (gu; without split-N,
// whose row test is not window-relative: the same sums); FC2's dgrad + SwiGLU' (h from the gate/up
// rows with FC1's bits, the router-weight gradient), then FC1's dgrad and beside it (the side
// stream, side_stream.h) the weight gradients over each expert's part of the window, then the
// d_x rows pushed into their slots with the router-gradient sums (routed_dgrads). The expert cut by the window's end is held over (bf16, windows
// inside the activation budget, rows that fit the hold: schedule_math.h's WindowHold; its x, d_y
// and h rows copied to hold buffers in the unused gu scratch, its d_gu rows read where they are
// saved, and the next window's wgrads run it whole: WgradArgs::hold_*), or else carried to the
// next in fp32 (WgradArgs::carry_in / carry_out): every gradient the resident backward's bits
// (windows are whole tiles, so every sum runs in the same K order). The wgrads schedule the
// window's experts only (WgradArgs::expert_range, sched::window_owns): at DeepSeek-V3 EP 1 a ring
// of 8192 rows holds ~32 of 256 experts, and the empty tiles of the other 224 (~300k per window)
// cost more than the window's MMAs. With Config::backward_path fused a window's dgrads and weight
// gradients are one kernel (the backward's GEMM program, which carries: its producer has no
// registers for the hold), the same bits. FP8 / MXFP8 take the same windows, budget and carries
// (no holds: their token-block operands are transposed): FC1 again in FP8 (fp8_fc1_again), then the FP8 backward's steps over the window
// (fp8_backward_rows, layer_fp8_backward.cu: d_y's, d_gu's, h's and x's codes from the window's
// rows), bitwise the resident FP8 backward (LayerFp8BackwardWindows).
bool Layer::Impl::backward_windows(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream,
                                   const std::function<void()>& while_pulling) {
  const gpu::ScheduleView v = schedule->view();
  const int64_t R = ring_rows;
  gpu::MoveArgs move = move_args();
  move.sms = sms;  // the movement kernels run alone here (pulling ahead: on the lane, lane_move)
  // Carries: [down 0][down 1][gate/up 0][gate/up 1]; window w reads slot w & 1 (what window w - 1
  // wrote) and writes the other (the tiles of the expert carried in and of the one carried out
  // run unordered in one call).
  const int64_t down_floats = gemm::wgrad_carry_floats(H, I), gu_floats = gemm::wgrad_carry_floats(2 * I, H);
  float* carry_down[2] = {bwd_carry.get<float>(), bwd_carry.get<float>() + down_floats};
  float* carry_gu[2] = {carry_down[0] + 2 * down_floats, carry_down[0] + 2 * down_floats + gu_floats};
  // The tile widths of the resident backward's plans, so that the windows' GEMMs tile exactly as
  // its GEMMs do (a window's few tiles would otherwise pick 128-wide ones).
  const int64_t all_tiles = cap_rows / sched::kBlockM;
  int32_t* parts = bwd_windows.get<int32_t>();
  const int32_t* part_begin = parts;
  const int32_t* part_rows = parts + e_loc;
  const int32_t* carried = parts + 2 * e_loc;    // WindowEnds' {carry_in, carry_out}
  const int32_t* owned = parts + 2 * e_loc + 2;  // {first, owned}: the window's experts, their tiles only
  windows_marked = 0;
  const bool program = config.backward_path == BackwardPath::Fused;
  // Held rows instead of carries (bf16, four GEMM kernels, windows inside the activation budget:
  // schedule_math.h's WindowHold): the held-over expert's x, d_y and weighted h rows go to the end
  // of hold buffers in the gu scratch, which those windows leave unused (they read the saved rows;
  // its d_gu rows stay where the saved rows are); at most what the scratch holds, and a window.
  const int64_t hold_cap = bwd_hold && gu.p != nullptr ? mem.hold_rows : 0;  // (the plan's MemoryPlan::hold_rows)
  char* x_hold = static_cast<char*>(gu.p);
  char* dy_hold = x_hold + hold_cap * 2 * H;
  char* h_hold = dy_hold + hold_cap * 2 * H;
  int64_t prev_lo = 0;
  // FP8 / MXFP8: the dgrads' weight codes once for all windows (unless kept), FC1 again in FP8.
  if (fp8 && e_loc > 0 && !config.fp8_keep_weight_codes_t) fp8_backward_weight_codes(stream);
  // EP > 1 (pull_ahead, layer_impl.h): the pulls a window ahead on the lane, on bwd_comm_sms CTAs
  // beside the GEMMs, which leave those SMs free. Window w + 1's d_out rows once window w's dW_down
  // (and the hold's copy) have read d_y, its x rows once dW_gate/up has read x: no buffer is
  // doubled. The caller's stream waits for the d_out rows before FC2's dgrad (for the x rows too
  // before FC1 again), the side stream for the x rows before dW_gate/up.
  const bool ahead = pull_ahead && !program && cap_rows > 0;
  struct AheadReset {  // (however the loop ends)
    int& ctas;
    bool& lane_push;
    ~AheadReset() { ctas = 0, lane_push = false; }
  } ahead_reset{bwd_gemm_ctas, push_on_lane};
  const SideStream::Joiner lane_joiner(lane, stream);
  gpu::MoveArgs lane_move = move;
  lane_move.sms = config.bwd_comm_sms;
  const auto pull_ahead_rows = [&](int64_t plo, int64_t phi, bool x) {  // (on the lane)
    lane_move.row_begin = plo;
    lane_move.row_end = phi;
    const cudaStream_t ls = lane.target(stream);
    if (x) {
      gpu::pull_dispatch(lane_move, x_peers.get<const void* const>(), x_rows, ls);
      x_pulled.record(ls);
    } else {
      pull_dy_rows(lane_move, ls);
      dy_pulled.record(ls);
    }
  };
  if (ahead) {
    bwd_gemm_ctas = sms - config.bwd_comm_sms;
    push_on_lane = true;
    lane.fork(stream);
    const int64_t hi0 = sched::window_end(0, R, cap_rows, saved_rows);
    pull_ahead_rows(0, hi0, false);
    pull_ahead_rows(0, hi0, true);
  }
  // The caller's work that reads no routed row (the shared expert's backward), on the GEMMs' SMs
  // while the lane pulls the first window.
  const bool called = ahead && while_pulling;
  if (called) while_pulling();
  // The windows cover the worst case: those past the routed rows compute nothing, and the host
  // never waits for the row count. MOK_BWD_SYNC_WINDOWS (a measurement knob, not under capture;
  // the same bits) waits on the host for the schedule's padded row count: 1 then issues only the
  // windows up to it, the last of them owning what the last window owns; 2 waits the same and
  // issues every window (the control: 2 against 1 prices the empty windows without the wait's own
  // cost, most of the windows at EP 8: notes/memory.md). The wait needs one host thread per rank
  // (it waits for the barrier above, which the other ranks' calls complete).
  int64_t end = cap_rows;
  if (sync_windows > 0 && marking) {
    gpu::ScheduleTotals totals{};
    MOK_CUDA_CHECK(cudaMemcpyAsync(&totals, v.totals, sizeof totals, cudaMemcpyDeviceToHost, stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (sync_windows == 1) end = std::clamp<int64_t>(totals.total_rows, sched::kBlockM, cap_rows);
  }
  for (int64_t lo = 0, w = 0; lo < end; ++w) {
    const int in = int(w & 1), out = in ^ 1;
    const int64_t hi = sched::window_end(lo, R, cap_rows, saved_rows);
    const bool from_saved = hi <= saved_rows;
    // x_beside: a saved window's x rows, which only dW_gate/up reads, pulled by FC2's dgrad's idle
    // producer warps beside its MMAs (gemm::RowPull) instead of before it with the d_out rows.
    const bool x_in_d2 = x_beside && from_saved && !ahead;
    const int64_t tiles = (hi - lo) / sched::kBlockM;
    const int32_t* tile_expert = v.tile_expert + lo / sched::kBlockM;
    move.row_begin = lo;
    move.row_end = hi;
    win_mark(w, 0, stream);
    // bf16: the window's x rows and d_out rows in one kernel (FC1 again reads the x rows next;
    // x_in_d2: the d_out rows alone); FP8 pulls its d_y rows (or codes) in fp8_backward_rows.
    if (fp8) {
      gpu::pull_dispatch(move, x_peers.get<const void* const>(), x_rows, stream);
    } else if (ahead) {  // (pulled on the lane: FC1 again reads the x rows)
      dy_pulled.wait(stream);
      if (!from_saved) x_pulled.wait(stream);
    } else {
      pull_dy_rows(move, stream, x_in_d2 ? nullptr : x_rows);
    }
    win_mark(w, 1, stream);
    // The window's gate/up rows: the forward's (d_gu is written over them: one backward per
    // forward), or FC1 again (its h output is overwritten unread: FC2's dgrad computes h from gu).
    void* gu_rows = from_saved ? static_cast<char*>(gu_saved.p) + lo * 4 * I : gu.p;
    if (!from_saved && fp8)
      fp8_fc1_again(x_rows, hi - lo, gu.p, tile_expert, tiles, stream);
    else if (!from_saved)
      gemm::run(gemm::plan_fc1(routed_fc1(x_rows, h.p, gu.p, tile_expert, tiles), options_as(all_tiles, 2 * I)),
                stream);
    win_mark(w, 2, stream);
    if (fp8) {  // the FP8 backward's steps over the window (layer_fp8_backward.cu)
      gpu::window_parts(v, e_loc, lo, hi, hi >= end, parts, stream);  // (its quantizers' segments too)
      Fp8Window fw;
      fw.rows = hi - lo;
      fw.tiles = tiles;
      fw.width_tiles = all_tiles;
      fw.tile_expert = tile_expert;
      fw.row_begin = part_begin;
      fw.expert_rows = part_rows;
      fw.gu_rows = gu_rows;
      fw.x_rows = x_rows;
      fw.carry_in[0] = carry_down[in];
      fw.carry_in[1] = carry_gu[in];
      fw.carry_out[0] = carry_down[out];
      fw.carry_out[1] = carry_gu[out];
      fw.carried = carried;
      fw.rows_total = v.expert_rows;
      fw.owned = owned;
      fp8_backward_rows(move, fw, dw_gate, dw_up, dw_down, stream, [&](int i) {
        if (i >= 3) win_mark(w, i, stream);  // (3: dgrads + pushes, 4: wgrad down, in 3 with the side stream)
      });
      win_mark(w, 5, stream);
      prev_lo = lo;
      lo = hi;
      continue;
    }
    gemm::WgradArgs wd = wgrad_args(dy_routed.p, h.p, dw_down, H, I, e_loc, hi - lo, part_begin, part_rows, nullptr,
                                    carry_down[in], carry_down[out], carried, v.expert_rows, owned);
    gemm::WgradArgs w1 = wgrad_args(gu_rows, x_rows, dw_gate, 2 * I, H, e_loc, hi - lo, part_begin, part_rows, dw_up,
                                    carry_gu[in], carry_gu[out], carried, v.expert_rows, owned);
    wd.accumulate = w1.accumulate = bwd_accumulate;  // GradRefs::accumulate (not on the program's path)
    const sched::WindowHold hold{hold_cap, prev_lo, hold_cap > 0 ? saved_rows : 0};
    if (hold_cap > 0 && lo > 0 && from_saved) {  // (an expert held in: its first rows are there)
      wd.hold_a = dy_hold;
      wd.hold_b = h_hold;
      wd.hold_a_rows = wd.hold_b_rows = wd.hold_a_row = wd.hold_b_row = hold_cap;
      w1.hold_a = gu_saved.p;  // (d_gu over the saved rows: the held rows' are those before lo)
      w1.hold_a_rows = saved_rows;
      w1.hold_a_row = lo;
      w1.hold_b = x_hold;
      w1.hold_b_rows = w1.hold_b_row = hold_cap;
    }
    if (program) {  // the weight gradients in the dgrads' kernel (the window's parts first)
      gpu::window_parts(v, e_loc, lo, hi, hi >= end, parts, stream);
      routed_dgrads(move, gu_rows, tile_expert, tiles, all_tiles, stream, false, &wd, &w1, true);
      for (int i = 3; i <= 5; ++i) win_mark(w, i, stream);
    } else {
      // The window's parts and weight gradients (and the hold's copy) beside FC1's dgrad, on the
      // side stream forked after FC2's dgrad and joined before the pushes (side_stream.h), or
      // after them at EP > 1; so before the next window's pulls overwrite the x and d_y rows they
      // read, or pulling ahead through dy_read / x_read. With the fork the stages "wgrad down"
      // and "wgrad gate/up" (kWinStageNames[3], [4]) read ~0: their time is in "dgrads + pushes".
      // Pulling ahead, window w's pushes run on the lane, so their time shows in window w + 1's
      // "pulls" (the last window's after its marks).
      const auto wgrads = [&](cudaStream_t ws, const gemm::Options& wo) {
        if (ws == stream) win_mark(w, 3, stream);
        // The expert this window holds over (if any) into the hold buffers' ends, after this
        // window's wgrads, which read the rows the previous window held in the same buffers:
        // its x rows after dW_gate/up, its d_y and h rows after dW_down (pulling ahead) or with
        // the x rows.
        const bool holds = hold_cap > 0 && hi < saved_rows;
        gpu::HoldCopy c;
        c.hold_rows = hold_cap;
        const auto hold_copy = [&](const void* from, void* to, int64_t row_bytes) {
          c.from[c.count] = from;
          c.to[c.count] = to;
          c.row_bytes[c.count] = row_bytes;
          ++c.count;
        };
        const bool next = hi < end;
        const int64_t next_hi = next ? sched::window_end(hi, R, cap_rows, saved_rows) : hi;
        gpu::window_parts(v, e_loc, lo, hi, hi >= end, parts, ws, hold);
        gemm::run(gemm::plan_wgrad(wd, wo), ws);
        if (ws == stream) win_mark(w, 4, stream);
        if (holds) {
          hold_copy(dy_routed.p, dy_hold, 2 * H);
          hold_copy(h.p, h_hold, 2 * I);
        }
        if (ahead) {
          if (holds) gpu::hold_rows(parts, e_loc, c, sms, ws);
          c.count = 0;
          dy_read.record(ws);  // the next window's d_out rows over this one's d_y
          dy_read.wait(lane.target(stream));
          if (next) pull_ahead_rows(hi, next_hi, false);
          x_pulled.wait(ws);
        }
        gemm::run(gemm::plan_wgrad(w1, wo), ws);
        if (holds) hold_copy(x_rows, x_hold, 2 * H);
        if (holds) gpu::hold_rows(parts, e_loc, c, sms, ws);
        if (ahead) {
          x_read.record(ws);  // and its x rows over this one's
          x_read.wait(lane.target(stream));
          if (next) pull_ahead_rows(hi, next_hi, true);
        }
      };
      const gemm::RowPull xg = x_in_d2 ? x_pull(move) : gemm::RowPull{};
      routed_dgrads(move, gu_rows, tile_expert, tiles, all_tiles, stream, false, nullptr, nullptr, true, wgrads,
                    x_in_d2 ? &xg : nullptr);
      if (side.on())
        for (int i = 3; i <= 4; ++i) win_mark(w, i, stream);
      win_mark(w, 5, stream);
    }
    prev_lo = lo;
    lo = hi;
  }
  lane.join(stream);
  return called;
}

// MOK_PROFILE=1, outside capture: the events of window w (created on first use; a backward records
// them in order, so window w's stage i + 1 closes stage i).
void Layer::Impl::win_mark(int64_t w, int i, cudaStream_t stream) {
  if (!marking || !profile) return;
  const size_t at = static_cast<size_t>(w * (kWinStages + 1) + i);
  while (win_marks.size() <= at) {
    cudaEvent_t e = nullptr;
    MOK_CUDA_CHECK(cudaEventCreate(&e));
    win_marks.push_back(e);
  }
  MOK_CUDA_CHECK(cudaEventRecord(win_marks[at], stream));
  if (i == kWinStages) windows_marked = w + 1;
}

}  // namespace mok
