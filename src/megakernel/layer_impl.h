// mok — the GPU layer's state (Layer::Impl), shared by its two halves: layer.cu (construction,
// forward, checks) and layer_backward.cu (backward). Private to src/megakernel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/device.cuh"
#include "common/cuda_check.h"
#include "common/device_error.h"
#include "megakernel/dispatch.h"
#include "megakernel/forward_kernel.h"
#include "megakernel/forward_setup.h"
#include "megakernel/side_stream.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "mok/layer.hpp"
#include "mok/memory.hpp"
#include "schedule/schedule_gpu.h"

namespace mok {

namespace layer_detail {

// One forward()/backward() on a communicator: refuses a communicator that failed before anything
// is enqueued, orders the stream after the communicator's previous call (Communicator::begin_call)
// and marks the end of this one when it goes, also when the call throws.
class CallScope {
 public:
  CallScope(comm::Communicator& c, cudaStream_t s, const char* who) : c_(c), s_(s) {
    c_.check_usable();  // an earlier failure, here or on a peer, is raised again: nothing is enqueued
    c_.begin_call(s_, who);
  }
  ~CallScope() {
    try {
      c_.end_call(s_);
    } catch (...) {
      // never throw from a destructor; the next call then waits on an older event only
    }
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  comm::Communicator& c_;
  cudaStream_t s_;
};

// Owned device allocation, or a view of a workspace buffer other layers share (`shared` keeps it
// alive; this one does not free it).
struct DeviceBuffer {
  void* p = nullptr;
  std::shared_ptr<DeviceBuffer> shared;
  DeviceBuffer() = default;
  static DeviceBuffer view(std::shared_ptr<DeviceBuffer> of) {
    DeviceBuffer b;
    b.p = of->p;
    b.shared = std::move(of);
    return b;
  }
  // Zeroed once: a tile's padding rows are read by the next GEMM (and their results dropped)
  // before anything wrote them, and no kernel may read memory nobody wrote (compute-sanitizer's
  // initcheck flags it; a NaN pattern left there would be harmless but is not worth the doubt).
  explicit DeviceBuffer(size_t bytes, const char* what) {
    cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (e == cudaSuccess) e = cudaMemset(p, 0, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess)
      throw Error(ErrorKind::Runtime, what, cudaGetErrorString(e), detail::concat(bytes, " bytes"));
  }
  ~DeviceBuffer() {
    if (p && !shared) cudaFree(p);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p), shared(std::move(o.shared)) { o.p = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p, o.p);
    std::swap(shared, o.shared);
    return *this;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(p); }
};

// The workspace of the layers on one communicator (Config::share_workspace): one buffer per name,
// handed to every layer that needs no more bytes than it has. A layer that needs more gets a new
// one, which later layers then share; the older buffer lives on with the layers that hold it
// (their tensor maps point into it), so nothing is ever reallocated under a layer. Layers on a
// communicator run one call at a time, so they never use a workspace buffer at once.
// A symmetric window the layers on a communicator share (Config::share_workspace): given back
// to the communicator's pool when its last holder goes, unless one of them could not synchronize
// its device (`keep`: a kernel might still use it).
struct SharedWindow {
  comm::Communicator* comm = nullptr;
  const comm::Window* window = nullptr;
  bool keep = false;
  SharedWindow(comm::Communicator& c, const comm::Window& w) : comm(&c), window(&w) {}
  ~SharedWindow() {
    if (keep) return;
    try {
      comm->release_window(*window);
    } catch (...) {
      // never throw from a destructor; a window left out of the pool is only memory
    }
  }
  SharedWindow(const SharedWindow&) = delete;
  SharedWindow& operator=(const SharedWindow&) = delete;
};

class Workspace {
 public:
  std::shared_ptr<DeviceBuffer> get(const std::string& name, size_t bytes);
  // Collective when it takes a new window (Communicator::acquire_window): every rank builds its
  // layers in the same order, so every rank decides alike whether the window it holds fits.
  std::shared_ptr<SharedWindow> window(comm::Communicator& comm, const std::string& name, size_t bytes);
  // Which of `plan`'s shared windows this rank would reuse rather than take anew (bit i: the i-th
  // symmetric workspace buffer of the plan): compared across ranks before any is taken, so ranks
  // whose layers came and went in another order are named instead of meeting in different
  // collectives.
  int64_t windows_reused(const MemoryPlan& plan);
  // The workspace of `comm`'s layers (created with the first one that shares).
  static std::shared_ptr<Workspace> of(const comm::Communicator& comm);

 private:
  struct Entry {
    std::weak_ptr<DeviceBuffer> buffer;
    size_t bytes = 0;
  };
  struct WindowEntry {
    std::weak_ptr<SharedWindow> window;
    size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, WindowEntry> windows_;
};

template <typename T>
DeviceBuffer upload_array(const std::vector<T>& v, const char* what) {
  DeviceBuffer b(v.size() * sizeof(T), what);
  MOK_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

// The layer's symmetric windows, taken from the communicator's pool and given back when the
// layer goes, also when its constructor throws (no kernel has used them then). `keep`: not given
// back (the device could not be synchronized, so a kernel might still use them).
struct WindowLeases {
  comm::Communicator* comm = nullptr;
  std::vector<const comm::Window*> held;
  bool keep = false;
  const comm::Window* acquire(comm::Communicator& c, const std::string& name, size_t bytes) {
    comm = &c;
    held.push_back(&c.acquire_window(name, bytes));
    return held.back();
  }
  WindowLeases() = default;
  WindowLeases(const WindowLeases&) = delete;
  WindowLeases& operator=(const WindowLeases&) = delete;
  ~WindowLeases() {
    if (keep || comm == nullptr) return;
    for (auto it = held.rbegin(); it != held.rend(); ++it) {
      try {
        comm->release_window(**it);
      } catch (...) {
        // never throw from a destructor; a window left out of the pool is only memory
      }
    }
  }
};

}  // namespace layer_detail

struct Layer::Impl {
  using DeviceBuffer = layer_detail::DeviceBuffer;
  using Workspace = layer_detail::Workspace;
  comm::Communicator& comm;
  layer_detail::WindowLeases leases;  // every window below
  LayerShape shape;
  Config config;
  DeviceWeights weights;
  int rank = 0, world = 1;
  int64_t H = 0, I = 0, k = 0, e_loc = 0, Is = 0, T = 0, cap_rows = 0, t_tiles = 0;
  const comm::Window* win_routing = nullptr;
  const comm::Window* win_x = nullptr;
  const comm::Window* win_combine = nullptr;
  // backward: d_out [T_pad, H] bf16, pulled by the peers (FP8 at EP 1: its 1 x 128 codes and scales
  // after the rows, fp8_bwd::dout_window)
  const comm::Window* win_dout = nullptr;
  const comm::Window* win_weights = nullptr;  // backward: router weights [T, k] f32, read by the peers
  const comm::Window* win_dweights = nullptr; // backward: their gradient [T, k] f32, written by the peers
  int64_t layer_number = 0;  // the communicator's window count when the layer was built: the same on every rank
  // Config::share_workspace: the windows above that no later call reads (all but the routing)
  // are the workspace's, held here.
  std::vector<std::shared_ptr<layer_detail::SharedWindow>> shared_windows;
  bool x_window_shared = false;  // win_x is the workspace's: backward() stages RoutingRefs::x again
  // The last forward read the caller's x in place (ForwardParams::x_local): win_x does not hold it,
  // so a backward that re-pulls x rows (over windows) stages it there first.
  bool x_from_caller = false;
  // A window of the plan's buffer `name`: the workspace's when the plan puts it there, else this
  // layer's own lease.
  const comm::Window* acquire_window(const std::string& tag, const char* name);
  MemoryPlan mem;  // the bytes of every buffer below (include/mok/memory.hpp)
  std::shared_ptr<Workspace> workspace;  // Config::share_workspace: the communicator's
  // The plan's buffer `name`: this layer's own, or a view of the shared workspace's when the plan
  // puts it there.
  DeviceBuffer allocate(const char* name, const char* what);
  comm::dev::DeviceComm dc{};
  DeviceErrorWord errors;
  DeviceBuffer tables, x_peers, combine_peers, dout_peers, weight_peers, dweight_peers, call_peers;
  std::unique_ptr<gpu::ScheduleBuilder> schedule;
  DeviceBuffer x_routed, gu, h, y;
  DeviceBuffer shared_tiles, gu_s, h_s, y_s;
  // Backward: what the forward leaves for it, and its own buffer (allocated by the first
  // backward(): an inference-only layer never pays for it).
  void* x_rows = nullptr;  // routed x rows of the last forward (x_routed, or the megakernel's ring)
  int64_t ring_rows = 0;   // megakernel: rows of the ring (0 on the unfused path)
  bool saved = false;      // the last forward() stored gu (save_for_backward)
  DeviceBuffer dy_routed, shared_rows;
  // Backward: the routed rows' router weights and the router-weight gradient's partial sums
  // (FC2 dgrad's epilogue: gemm::DgradSwiGLUArgs::router_partial), rows of dy_routed's.
  DeviceBuffer row_weights, router_partials;
  // The megakernel with a ring below the worst case: the backward runs over windows of the ring's
  // rows (backward_windows), with these (allocated by the first backward: the plan's bwd_carry,
  // bwd_windows).
  bool windowed = false;
  DeviceBuffer bwd_carry, bwd_windows;
  DeviceBuffer bwd_counters;  // Config::backward_path fused: the program's ticket and D2 counters
  // Its ticket order (mk::BwdGemmShape::merge; MOK_BWD_ORDER): phased by default, which measured
  // faster than merged (notes/backward.md).
  int32_t bwd_merge = 0;
  // This backward's GradRefs::accumulate: the routed weight gradients added to fp32 tensors.
  bool bwd_accumulate = false;
  // Windowed: the forward's gate/up rows [saved_rows, 2I] of the schedule's first saved_rows rows
  // (the activation budget; FC1's TMA stores clip the rows past it), which the backward reads
  // instead of recomputing FC1.
  int64_t saved_rows = 0;
  DeviceBuffer gu_saved;
  // Config::saved_forwards > 1: the saved state of every forward alive. The members above that
  // hold a forward's state (schedule, gu_saved, gu_s, h_s, saved, the tensor maps into them) and
  // saved_routing are the active forward's; slots[i] holds forward i's (forward g uses slot
  // g % saved_forwards) while another is active, slots[active] being empty then.
  struct SavedSlot {
    std::unique_ptr<gpu::ScheduleBuilder> schedule;
    DeviceBuffer gu_saved, gu_s, h_s, routing;
    CUtensorMap gu_map{}, gus_out{}, hs_out{}, hs_in{};
    bool saved = false;
    int64_t generation = -1;
  };
  std::vector<SavedSlot> slots;
  int active = 0;
  int64_t forwards = 0;            // forward() calls so far: the last one is number forwards - 1
  int64_t active_generation = -1;  // the forward whose state the members hold
  DeviceBuffer saved_routing;      // its copy of its published routing (saved_forwards > 1)
  void setup_saved_slots();
  void swap_slot(int i);  // the members <-> slots[i]
  void activate(int i);
  // Several forwards alive choose their slots on the host, which a replayed CUDA graph would not
  // repeat: refused (naming config.saved_forwards) while `stream` is capturing.
  void refuse_capture_with_slots(cudaStream_t stream) const;
  // The routing the backward reads: the forward's own copy with several forwards alive.
  const int32_t* backward_routing() const {
    return slots.size() > 1 ? saved_routing.get<const int32_t>() : published();
  }
  // MOK_PROFILE=1: events at the backward's stage boundaries (profile_summary reports the last one).
  static constexpr int kBwdStages = 11;
  static constexpr const char* kBwdStageNames[kBwdStages] = {
      "routing check", "barrier", "reverse-combine pull", "FC2 dgrad + SwiGLU' + router grad", "FC1 dgrad",
      "router-grad + reverse-dispatch push", "wgrad down", "wgrad gate/up", "barrier", "shared expert", "d_x merge"};
  bool profile = false;
  bool bwd_hold = true;  // MOK_BWD_HOLD: the windows hold cut experts' rows (else carry them)
  int sync_windows = 0;  // MOK_BWD_SYNC_WINDOWS (read_knobs): 1 only the windows up to the routed rows, 2 all (a host wait)
  bool group_experts = true;  // MOK_GROUP_EXPERTS (read_knobs): the backward's M-grouped GEMMs' groups split at experts
  bool dx_scatter = true;     // MOK_DX_SCATTER (allocate_backward): FC1's dgrad stores the d_x rows into their slots
  // MOK_BWD_X_BESIDE (allocate_backward): a window inside the activation budget has its x rows
  // pulled by FC2's dgrad's idle producer warps beside its MMAs (gemm::RowPull), not by the
  // d_out rows' kernel before it (layer_backward_windows.cu).
  bool x_beside = false;
  SideStream side;       // the weight gradients beside FC1's dgrad (side_stream.h)
  // The pushes beside the weight gradients (EP > 1; MOK_BWD_PUSH_BESIDE=0/1 overrides): on
  // config.bwd_comm_sms CTAs, which the weight gradients then leave free (else after the join).
  bool push_beside = false;
  // The windows' pulls ahead (EP > 1; MOK_BWD_PULL_AHEAD=0/1 overrides): window w + 1's d_out
  // rows pulled on `lane` once window w's dW_down has read its own, its x rows once dW_gate/up has,
  // on config.bwd_comm_sms CTAs beside the GEMMs, which then leave those SMs free
  // (layer_backward_windows.cu). The marks order the three streams.
  bool pull_ahead = false;
  SideStream lane;
  StreamMark dy_pulled, x_pulled, dy_read, x_read, d1_done;
  int bwd_gemm_ctas = 0;      // the backward's GEMMs' CTAs (0 = one per SM; options_as)
  bool push_on_lane = false;  // routed_dgrads pushes on the lane (pulling ahead)
  // routed_dgrads' work on the side stream: the stream, and the options its GEMMs take.
  using Beside = std::function<void(cudaStream_t, const gemm::Options&)>;
  std::vector<cudaEvent_t> bwd_marks;
  bool marking = false;     // this backward records them (not under stream capture)
  bool bwd_marked = false;  // the last backward recorded all of them
  void mark(int i, cudaStream_t stream) {
    if (marking && !bwd_marks.empty()) MOK_CUDA_CHECK(cudaEventRecord(bwd_marks[static_cast<size_t>(i)], stream));
  }
  // The backward over windows (one stage above): kWinStages per window, summed over the windows.
  static constexpr int kWinStages = 5;
  // (Stage 0 pulls the x rows, in bf16 with the d_out rows: FP8 pulls d_y in its dgrads' stage.)
  static constexpr const char* kWinStageNames[kWinStages] = {"pulls", "FC1 again (past the budget)", "dgrads + pushes",
                                                             "wgrad down", "wgrad gate/up"};
  std::vector<cudaEvent_t> win_marks;  // window w's stage boundaries at [w * (kWinStages + 1), ...]
  int64_t windows_marked = 0;          // windows the last backward recorded
  void win_mark(int64_t w, int i, cudaStream_t stream);
  gemm::Plan fc1, fc2, fc1_s, fc2_s;
  gemm::Plan fc1_nogu, fc1_s_nogu;  // forward(..., save_for_backward = false)
  // Config::precision FP8 / MXFP8 (layer_fp8.cu): the weights' codes and 128 x 128 scales, made by
  // bind_weights, and the unfused path's FP8 GEMM plans (fc1_fp8 also stores the gate/up rows);
  // the backward's operands (layer_fp8_backward.cu, allocated by the first backward; the weight
  // codes by bind_weights when Config::fp8_keep_weight_codes_t).
  bool fp8 = false;  // FP8 or MXFP8: one runtime (MX quantized, then re-blocked to recipe 1's blocks)
  bool mx = false;   // MXFP8: x, the weights and h quantized as MX, then re-blocked (layer_fp8.cu)
  // This backward's d_y: 1 x 128 codes made by each rank in its d_out window and pulled, token blocks
  // gathered from the d_out windows (fp8_bwd::dy_at_source), not from a routed bf16 copy.
  bool dy_from_source = false;
  DeviceBuffer fp8_weights;
  gemm::Plan fc1_fp8, fc1_fp8_nogu, fc2_fp8;
  DeviceBuffer fp8_bwd_rows, fp8_bwd_weights;
  // Megakernel: ring buffers, counters, tensor maps and parameters.
  bool fused = true;
  int sms = 0;
  int grid = 0;  // megakernel CTAs (sms, or the SMs that pair up into 2-CTA clusters)
  DeviceBuffer counters;
  DeviceBuffer cluster_slots;  // 2-CTA clusters: rank 0's tasks for rank 1 (forward_kernel.h)
  // Push dispatch: the ring and the counter block are symmetric windows, and this rank builds
  // every receiver's schedule (receivers[d], null for itself: `schedule`).
  bool push = false;
  const comm::Window* win_ring = nullptr;
  const comm::Window* win_counters = nullptr;
  std::vector<std::unique_ptr<gpu::ScheduleBuilder>> receivers;
  DeviceBuffer dest_views, ring_peers, counter_peers;
  mk::ForwardMaps maps{};
  mk::ForwardParams mkp{};
  DeviceBuffer stats;  // MOK_PROFILE=1: per-CTA profile of the last megakernel

  Impl(comm::Communicator& c, const LayerShape& s, const Config& cfg, const DeviceWeights& w);
  // The windows go back to the communicator's pool (WindowLeases) once our own kernels are done:
  // synchronized here. The peers' kernels on them are ordered by the pool itself (a window is
  // reused only when every rank has given it back; see Communicator::acquire_window).
  ~Impl();
  void setup_unfused();
  void plan_unfused();
  void check_precision() const;  // what the FP8 layer supports so far, each refusal named
  int64_t x_scale_offset() const;
  void bind_weights_fp8();
  void setup_megakernel_fp8();
  void quantize_x_fp8(const void* x, cudaStream_t stream);
  void quantize_weight(const void* w, int64_t rows, int64_t cols, void* q, float* sc, cudaStream_t stream) const;
  void routed_forward_fp8(cudaStream_t stream, bool save);
  void backward_resident_fp8(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream);
  // The FP8 backward's routed rows of one window (layer_fp8_backward.cu; the resident backward is
  // one window of every row): where its rows' operands come from, and its weight gradients' parts.
  struct Fp8Window {
    int64_t rows = 0, tiles = 0;           // the window's rows (whole tiles) and tiles
    int64_t width_tiles = 0;               // the whole layout's tiles (the dgrads tile as over it; 0: own)
    bool weight_codes = false;             // make the dgrads' weight codes first (after the d_out pull)
    const int32_t* tile_expert = nullptr;  // the window's tiles'
    const int32_t* row_begin = nullptr;    // device [e_loc]: each expert's first row, window-relative
    const int32_t* expert_rows = nullptr;  // device [e_loc]: its token rows in the window
    void* gu_rows = nullptr;               // the window's gate/up rows (d_gu is written over them)
    const void* x_rows = nullptr;          // its bf16 x rows, or nullptr: read in the x windows
    // Over windows (Fp8WgradArgs): the carries of the expert cut at either end, the experts with
    // rows in any window, and the experts this window's wgrads own.
    const float* carry_in[2] = {nullptr, nullptr};  // {down, gate/up}
    float* carry_out[2] = {nullptr, nullptr};
    const int32_t* carried = nullptr;
    const int32_t* rows_total = nullptr;
    const int32_t* owned = nullptr;
  };
  // stage(i) after each step: 0 the d_out pull, 1 FC2's dgrad, 2 FC1's dgrad (with the side
  // stream also h's token blocks and dW_down beside it), 3 the router-gradient and reverse-
  // dispatch pushes, 4 x^T's token blocks (and without the side stream dW_down; dW_gate/up is the
  // caller's to mark).
  void fp8_backward_rows(const gpu::MoveArgs& move, const Fp8Window& w, void* dw_gate, void* dw_up, void* dw_down,
                         cudaStream_t stream, const std::function<void(int)>& stage);
  // A window's FP8 FC1 again (layer_fp8.cu): its bf16 x rows quantized as the forward's x was, the
  // gate/up rows into gu_rows (h's codes into h, not read).
  void fp8_fc1_again(const void* x_rows, int64_t rows, void* gu_rows, const int32_t* tile_expert, int64_t tiles,
                     cudaStream_t stream);
  // The rows fp8_bwd::rows_layout lays fp8_bwd_rows out for (memory_plan.cpp's bwd_rows): a window's.
  int64_t fp8_bwd_layout_rows() const { return windowed ? ring_rows : std::max<int64_t>(cap_rows, 128); }
  // FC1 of the routed experts over `tiles` 128-row tiles of x rows, with the bound weights.
  gemm::Fc1Args routed_fc1(const void* x, void* h_rows, void* gu_rows, const int32_t* tile_expert,
                           int64_t tiles) const;
  void setup_megakernel(const mk::ForwardSetup& fs);
  static void register_site_names();
  void read_knobs();  // the environment's experiment knobs (layer_backward.cu)
  void setup_push_dispatch();
  void bind_weights();
  void set_weights(const DeviceWeights& w);
  gpu::MoveArgs move_args() const;
  // Every in-kernel wait of the layer's GEMMs bounded by the config's timeout and given up once
  // any rank has failed (the communicator's abort word).
  gemm::Options gemm_options() const;
  // Checks common to forward() and backward() before anything is enqueued: the routing tensors'
  // shapes and memory (the call's scope has checked the communicator and ordered the stream).
  void check_routing(const RoutingRefs& in) const;
  void barrier(cudaStream_t stream);
  int64_t forward(const RoutingRefs& in, const TensorRef& out, cudaStream_t stream, bool save_for_backward);
  void backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& g, cudaStream_t stream,
                int64_t forward_id);
  void shared_backward(const DeviceGrads& g, cudaStream_t stream);
  void run_dgrads(const void* dy, const void* w_down, void* gu_buf, const void* w_gate, const void* w_up,
                  void* dx_rows, int64_t inter, int64_t experts, const int32_t* tile_expert, int64_t tiles,
                  cudaStream_t stream, int mark_between = -1, int64_t width_tiles = 0,
                  const float* row_weight = nullptr, float* router_partial = nullptr, void* h_rows = nullptr,
                  SideStream* fork_after_d2 = nullptr, const gemm::RowScatter* scatter = nullptr,
                  const gemm::RowPull* pull = nullptr);
  gemm::RowScatter row_scatter(const gpu::MoveArgs& move) const;
  // move's window of x rows into x_rows, as pull_dispatch copies them (gemm::RowPull; x_beside).
  gemm::RowPull x_pull(const gpu::MoveArgs& move) const;
  void dgrad_args(const void* dy, const void* w_down, void* gu_buf, const void* w_gate, const void* w_up,
                  void* dx_rows, int64_t inter, int64_t experts, const int32_t* tile_expert, int64_t tiles,
                  const float* row_weight, float* router_partial, void* h_rows, gemm::DgradSwiGLUArgs& ds,
                  gemm::DgradArgs& dx) const;
  void routed_dgrads(const gpu::MoveArgs& move, void* gu_rows, const int32_t* tile_expert, int64_t tiles,
                     int64_t width_tiles, cudaStream_t stream, bool marks, const gemm::WgradArgs* wd = nullptr,
                     const gemm::WgradArgs* w1 = nullptr, bool pulled = false,
                     const Beside& beside = {}, const gemm::RowPull* pull = nullptr);
  // The window's d_out rows and router weights pulled (reverse combine) into dy_routed / row_weights,
  // and with x_to its x rows into x_to in the same kernel.
  void pull_dy_rows(const gpu::MoveArgs& move, cudaStream_t stream, void* x_to = nullptr);
  void run_backward_program(const gemm::DgradSwiGLUArgs& ds, const gemm::DgradArgs& dx, const gemm::WgradArgs& wd,
                            const gemm::WgradArgs& w1, cudaStream_t stream);
  // gemm_options() with the tile width a plan over `width_tiles` M tiles and n columns picks
  // (0: the plan's own choice): a window's GEMMs then tile like the whole layout's.
  gemm::Options options_as(int64_t width_tiles, int64_t n) const;
  void run_wgrad(const void* a, const void* b, void* dw, int64_t m, int64_t n, int64_t experts, int64_t rows_total,
                 const int32_t* row_begin, const int32_t* rows, cudaStream_t stream, void* dw_up = nullptr) const;
  gemm::WgradArgs wgrad_args(const void* a, const void* b, void* dw, int64_t m, int64_t n, int64_t experts,
                             int64_t rows_total, const int32_t* row_begin, const int32_t* rows, void* dw_up = nullptr,
                             const float* carry_in = nullptr, float* carry_out = nullptr,
                             const int32_t* carry_experts = nullptr, const int32_t* expert_rows_total = nullptr,
                             const int32_t* expert_range = nullptr) const;

  void backward_resident(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream);
  // while_pulling: enqueued on `stream` while the lane pulls the first window's rows, when pulling
  // ahead (returns whether it was called; the shared expert's backward, at EP > 1).
  bool backward_windows(void* dw_gate, void* dw_up, void* dw_down, cudaStream_t stream,
                        const std::function<void()>& while_pulling = {});
  void allocate_backward();
  // The FP8 backward's K-major weight codes into fp8_bwd_weights (layer_fp8_backward.cu): by every
  // backward, or once per weight binding with Config::fp8_keep_weight_codes_t.
  void fp8_backward_weight_codes(cudaStream_t stream);
  std::string forward_profile() const;   // the megakernel's line of profile_summary, or ""
  std::string backward_profile() const;  // the last backward's stage times (MOK_PROFILE=1), or ""
  const int32_t* published() const { return static_cast<const int32_t*>(win_routing->ptr); }
};

}  // namespace mok
