// The unfused forward path of one rank (see include/mok/layer.hpp for the sequence and its
// synchronization argument).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/device.cuh"
#include "common/cuda_check.h"
#include "common/device_error.h"
#include "gemm/grouped_gemm.h"
#include "gemm/tensor_map.h"
#include "megakernel/dispatch.h"
#include "megakernel/forward_kernel.h"
#include "megakernel/merge.h"
#include "megakernel/reverse.h"
#include "mok/errors.hpp"
#include "mok/layer.hpp"
#include "schedule/schedule_gpu.h"
#include "schedule/schedule_math.h"

namespace mok {

namespace {

__global__ void barrier_kernel(__grid_constant__ const comm::dev::DeviceComm dc, uint32_t index) {
  comm::dev::lsa_barrier(dc, index);
}

// Owned device allocation.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes, const char* what) {
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess)
      throw Error(ErrorKind::Runtime, what, cudaGetErrorString(e), detail::concat(bytes, " bytes"));
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p) { o.p = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(p); }
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

}  // namespace

struct Layer::Impl {
  comm::Communicator& comm;
  WindowLeases leases;  // every window below
  LayerShape shape;
  Config config;
  DeviceWeights weights;
  int rank = 0, world = 1;
  int64_t H = 0, I = 0, k = 0, e_loc = 0, Is = 0, T = 0, cap_rows = 0, t_tiles = 0;
  const comm::Window* win_routing = nullptr;
  const comm::Window* win_x = nullptr;
  const comm::Window* win_combine = nullptr;
  const comm::Window* win_dout = nullptr;     // backward: d_out [T_pad, H] bf16, pulled by the peers
  const comm::Window* win_weights = nullptr;  // backward: router weights [T, k] f32, read by the peers
  comm::dev::DeviceComm dc{};
  DeviceErrorWord errors;
  DeviceBuffer tables, x_peers, combine_peers, dout_peers, weight_peers;
  std::unique_ptr<gpu::ScheduleBuilder> schedule;
  DeviceBuffer w1p, x_routed, gu, h, y;
  DeviceBuffer ws1p, shared_tiles, gu_s, h_s, y_s;
  // Backward: what the forward leaves for it, and its own buffer (allocated by the first
  // backward(): an inference-only layer never pays for it).
  void* x_rows = nullptr;  // routed x rows of the last forward (x_routed, or the megakernel's ring)
  int64_t ring_rows = 0;   // megakernel: rows of the ring (0 on the unfused path)
  bool saved = false;      // the last forward() stored gu (save_for_backward)
  DeviceBuffer dy_routed, shared_rows;
  // MOK_PROFILE=1: events at the backward's stage boundaries (profile_summary reports the last one).
  static constexpr int kBwdStages = 11;
  static constexpr const char* kBwdStageNames[kBwdStages] = {
      "router-weight grad", "barrier", "reverse-combine pull", "FC2 dgrad + SwiGLU'", "FC1 dgrad",
      "reverse-dispatch push", "wgrad down", "wgrad gate/up", "barrier", "shared expert", "d_x merge"};
  bool profile = false;
  std::vector<cudaEvent_t> bwd_marks;
  bool marking = false;     // this backward records them (not under stream capture)
  bool bwd_marked = false;  // the last backward recorded all of them
  void mark(int i, cudaStream_t stream) {
    if (marking && !bwd_marks.empty()) MOK_CUDA_CHECK(cudaEventRecord(bwd_marks[static_cast<size_t>(i)], stream));
  }
  gemm::Plan fc1, fc2, fc1_s, fc2_s;
  gemm::Plan fc1_nogu, fc1_s_nogu;  // forward(..., save_for_backward = false)
  // Megakernel: ring buffers, counters, tensor maps and parameters.
  bool fused = true;
  int sms = 0;
  int grid = 0;  // megakernel CTAs (sms, or the SMs that pair up into 2-CTA clusters)
  DeviceBuffer counters;
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

  // The windows go back to the communicator's pool (WindowLeases) once our own kernels are done:
  // synchronized here. The peers' kernels on them are ordered by the pool itself (a window is
  // reused only when every rank has given it back; see Communicator::acquire_window).
  ~Impl() {
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess;
    if (cudaSetDevice(comm.device()) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) leases.keep = true;
    for (cudaEvent_t e : bwd_marks) (void)cudaEventDestroy(e);
    if (restore) (void)cudaSetDevice(prev);
  }

  Impl(comm::Communicator& c, const LayerShape& s, const Config& cfg, const DeviceWeights& w)
      : comm(c), shape(s), config(cfg), weights(w) {
    comm::register_wait_name(comm::kWaitUserBase + 40, "megakernel.task_dependency");
    comm::register_wait_name(comm::kWaitUserBase + 41, "megakernel.comm_dependency");
    MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()));
    config.validate(shape, sms);
    fused = config.forward_path == ForwardPath::Megakernel;
    const char* prof = std::getenv("MOK_PROFILE");
    profile = prof != nullptr && std::string(prof) == "1";
    rank = comm.rank();
    world = comm.world_size();
    MOK_REQUIRE(world == shape.world_size(), "shape.tokens",
                "one entry per rank of the communicator is required (communicator has ", world,
                " ranks, shape has ", shape.world_size(), ")");
    H = shape.hidden;
    I = shape.intermediate;
    k = shape.top_k;
    e_loc = shape.local_experts();
    Is = shape.shared_intermediate;
    T = shape.tokens_of(rank);
    MOK_REQUIRE(w.w_gate && w.w_up && w.w_down, "weights", "w_gate, w_up and w_down must be given");
    MOK_REQUIRE(Is == 0 || (w.ws_gate && w.ws_up && w.ws_down), "weights",
                "the shared expert's ws_gate, ws_up and ws_down must be given when Is > 0");

    // Symmetric windows, equal on every rank (sized by the largest T), taken from the
    // communicator's pool when an earlier layer gave back one that fits. Names carry the number of
    // windows already registered so several layers can share one communicator.
    const int64_t t_max = shape.max_tokens(), t_max_pad = sched::pad_rows(t_max);
    const std::string tag = "mok.layer" + std::to_string(comm.window_count());
    win_routing = leases.acquire(comm, tag + ".routing", static_cast<size_t>(std::max<int64_t>(1, t_max * k)) * 4);
    win_x = leases.acquire(comm, tag + ".x", static_cast<size_t>(std::max<int64_t>(1, t_max_pad * H)) * 2);
    win_combine = leases.acquire(comm, tag + ".combine", static_cast<size_t>(std::max<int64_t>(1, t_max * k * H)) * 2);
    win_dout = leases.acquire(comm, tag + ".d_out", static_cast<size_t>(std::max<int64_t>(1, t_max_pad * H)) * 2);
    win_weights = leases.acquire(comm, tag + ".weights", static_cast<size_t>(std::max<int64_t>(1, t_max * k)) * 4);
    dc = comm::dev::make_device_comm(comm);
    std::vector<const void*> tab(world), xp(world), dp(world), wp(world);
    std::vector<void*> cp(world);
    for (int r = 0; r < world; ++r) {
      tab[r] = comm::dev::lsa_pointer(comm, *win_routing, r);
      xp[r] = comm::dev::lsa_pointer(comm, *win_x, r);
      cp[r] = comm::dev::lsa_pointer(comm, *win_combine, r);
      dp[r] = comm::dev::lsa_pointer(comm, *win_dout, r);
      wp[r] = comm::dev::lsa_pointer(comm, *win_weights, r);
    }
    tables = upload_array(tab, "schedule tables");
    x_peers = upload_array(xp, "x peers");
    combine_peers = upload_array(cp, "combine peers");
    dout_peers = upload_array(dp, "d_out peers");
    weight_peers = upload_array(wp, "router weight peers");
    schedule = std::make_unique<gpu::ScheduleBuilder>(shape, config, rank, tables.get<const int32_t* const>());

    cap_rows = shape.worst_case_rows();
    t_tiles = sched::ceil_div(T, sched::kBlockM);
    w1p = DeviceBuffer(static_cast<size_t>(e_loc * 2 * I * H) * 2, "w1p");
    // gate/up pre-activations of every routed row (kept for backward on both paths). Not written
    // by forward(..., save_for_backward = false): a backward must know whether the last forward
    // saved them (track it when the backward lands; a captured graph fixes the flag).
    // (at least one tile of rows, so tensor maps stay valid when no rank has tokens)
    gu = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(cap_rows, sched::kBlockM) * 2 * I) * 2, "gu");
    const bool has_shared = Is > 0 && T > 0;
    if (has_shared) {
      ws1p = DeviceBuffer(static_cast<size_t>(2 * Is * H) * 2, "ws1p");
      gu_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * 2 * Is) * 2, "gu_s");
      h_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * Is) * 2, "h_s");
      y_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * H) * 2, "y_s");
    }
    if (fused)
      setup_megakernel();
    else
      setup_unfused();
    repack(nullptr);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Unfused path: routed buffers for the worst case (one macrobatch) and one GEMM plan per stage.
  void setup_unfused() {
    x_routed = DeviceBuffer(static_cast<size_t>(cap_rows * H) * 2, "x_routed");
    x_rows = x_routed.p;
    h = DeviceBuffer(static_cast<size_t>(cap_rows * I) * 2, "h");
    y = DeviceBuffer(static_cast<size_t>(cap_rows * H) * 2, "y");
    const gpu::ScheduleView v = schedule->view();
    gemm::Fc1Args a1;
    a1.x = x_routed.p;
    a1.w1p = w1p.p;
    a1.h = h.p;
    a1.gu = gu.p;
    a1.hidden = H;
    a1.inter = I;
    a1.experts = e_loc;
    a1.tile_expert = v.tile_expert;
    a1.num_m_tiles = cap_rows / sched::kBlockM;
    a1.expert_row_begin = v.expert_offset;  // nearly empty tiles in split-N form
    a1.expert_rows = v.expert_rows;
    fc1 = gemm::plan_fc1(a1);
    gemm::Fc1Args a1_nogu = a1;  // forward(..., save_for_backward = false)
    a1_nogu.gu = nullptr;
    fc1_nogu = gemm::plan_fc1(a1_nogu);
    gemm::Fc2Args a2;
    a2.a = h.p;
    a2.w = weights.w_down;
    a2.y = y.p;
    a2.k = I;
    a2.n = H;
    a2.experts = e_loc;
    a2.tile_expert = v.tile_expert;
    a2.num_m_tiles = cap_rows / sched::kBlockM;
    a2.expert_row_begin = v.expert_offset;
    a2.expert_rows = v.expert_rows;
    fc2 = gemm::plan_fc2(a2);
    // Shared expert: one "expert" over this rank's tokens, read straight from the x window.
    if (Is > 0 && T > 0) {
      shared_tiles = upload_array(std::vector<int32_t>(static_cast<size_t>(t_tiles), 0), "shared tiles");
      gemm::Fc1Args s1 = a1;
      s1.x = win_x->ptr;
      s1.w1p = ws1p.p;
      s1.h = h_s.p;
      s1.gu = gu_s.p;
      s1.inter = Is;
      s1.experts = 1;
      s1.tile_expert = shared_tiles.get<const int32_t>();
      s1.num_m_tiles = t_tiles;
      s1.expert_row_begin = s1.expert_rows = nullptr;  // one "expert": no split-N
      fc1_s = gemm::plan_fc1(s1);
      s1.gu = nullptr;
      fc1_s_nogu = gemm::plan_fc1(s1);
      gemm::Fc2Args s2 = a2;
      s2.a = h_s.p;
      s2.w = weights.ws_down;
      s2.y = y_s.p;
      s2.k = Is;
      s2.experts = 1;
      s2.tile_expert = shared_tiles.get<const int32_t>();
      s2.num_m_tiles = t_tiles;
      s2.expert_row_begin = s2.expert_rows = nullptr;
      fc2_s = gemm::plan_fc2(s2);
    }
  }

  // Megakernel: the ring (macrobatch) buffers, the counter block and the tensor maps.
  void setup_megakernel() {
    const int64_t mb = config.resolved_minibatch(shape), ring = config.resolved_macrobatch(shape);
    MOK_REQUIRE(ring >= cap_rows || ring >= 2 * mb, "config.macrobatch_tokens",
                "the megakernel's ring must hold at least two minibatches (2 x ", mb,
                " rows) when it is smaller than the worst case (", cap_rows, " rows), got ", ring);
    MOK_REQUIRE(Is == 0 || Is % 64 == 0, "shape.shared_intermediate", "must be a multiple of 64, got ", Is);
    MOK_REQUIRE(H <= mk::forward_max_hidden(), "shape.hidden",
                "the megakernel's comm CTAs stage whole rows in shared memory: at most ",
                mk::forward_max_hidden(), ", got ", H);
    // Never more than can be used; at least one tile (valid tensor maps without any tokens).
    const int64_t R = std::max<int64_t>(sched::kBlockM, std::min(ring, sched::round_up(cap_rows, mb)));
    push = config.dispatch == DispatchPath::Push;
    void* x_ring = nullptr;
    if (push) {
      // Other ranks write into our ring: a symmetric window (R is equal on every rank). Kernels
      // reach it through NCCL's flat alias only (as the peers do; see comm/device.cuh).
      win_ring = leases.acquire(comm, detail::concat("mok.layer", comm.window_count(), ".ring"),
                                  static_cast<size_t>(R * H) * 2);
      x_ring = comm::dev::lsa_pointer(comm, *win_ring, rank);
    } else {
      x_routed = DeviceBuffer(static_cast<size_t>(R * H) * 2, "x ring");
      x_ring = x_routed.p;
    }
    x_rows = x_ring;
    ring_rows = R;
    h = DeviceBuffer(static_cast<size_t>(R * I) * 2, "h ring");
    y = DeviceBuffer(static_cast<size_t>(R * H) * 2, "y ring");
    constexpr int64_t kBN = 256;
    mk::PlanShape& ps = mkp.plan;
    ps.mb_rows = static_cast<int32_t>(mb);
    ps.ring_rows = static_cast<int32_t>(R);
    ps.n1 = static_cast<int32_t>(sched::ceil_div(2 * I, kBN));
    ps.n2 = static_cast<int32_t>(sched::ceil_div(H, kBN));
    const bool has_shared = Is > 0 && T > 0;
    ps.s_tiles = has_shared ? static_cast<int32_t>(t_tiles) : 0;
    ps.n1s = static_cast<int32_t>(sched::ceil_div(2 * Is, kBN));
    ps.n2s = ps.n2;
    ps.comm_ctas = config.resolved_fwd_comm_sms(shape);
    mkp.cluster = config.fwd_clusters ? 1 : 0;
    ps.pair = mkp.cluster;
    ps.group_m = mkp.cluster ? 4 : 8;  // raster groups of 8 M tiles (as the grouped GEMM)
    mkp.layout.max_positions = static_cast<int32_t>(sched::ceil_div(cap_rows, mb));
    mkp.layout.max_tiles = static_cast<int32_t>(cap_rows / sched::kBlockM);
    mkp.layout.s_tiles = ps.s_tiles;
    MOK_REQUIRE(mk::num_tickets(ps, mkp.layout.max_positions) < (int64_t(1) << 31), "shape",
                "the megakernel's task tickets (", mk::num_tickets(ps, mkp.layout.max_positions),
                ") must fit 31 bits");
    const size_t counter_bytes = static_cast<size_t>(mkp.layout.words()) * 4;
    if (push) {
      // Equal on every rank: the shared expert's words (the last ones) sized for the largest T.
      mk::CounterLayout widest = mkp.layout;
      widest.s_tiles = Is > 0 ? static_cast<int32_t>(sched::ceil_div(shape.max_tokens(), sched::kBlockM)) : 0;
      win_counters = leases.acquire(comm, detail::concat("mok.layer", comm.window_count(), ".counters"),
                                      static_cast<size_t>(widest.words()) * 4);
      // The flat alias, which the peers' and our own comm CTAs' remote adds also use.
      mkp.counters = static_cast<uint32_t*>(comm::dev::lsa_pointer(comm, *win_counters, rank));
      setup_push_dispatch();
    } else {
      counters = DeviceBuffer(counter_bytes, "megakernel counters");
      mkp.counters = counters.get<uint32_t>();
    }
    grid = mk::prepare_forward(ps.comm_ctas, sms, mkp.cluster != 0);
    // Experiment knob (not API): MOK_MK_SKEW=1..4 staggers the consumer warpgroups so one's
    // epilogue overlaps the other's MMAs (see the engine's Skew).
    if (const char* sk = std::getenv("MOK_MK_SKEW")) mkp.skew_stages = std::clamp(std::atoi(sk), 0, 4);
    // MOK_MK_SPLIT_N=0: tiles with <= 64 token rows on warpgroup 0 alone (A/B of the split-N form).
    if (const char* sn = std::getenv("MOK_MK_SPLIT_N")) mkp.split_n = std::atoi(sn) != 0 ? 1 : 0;
    // MOK_MK_GROUP_M=n: raster groups of n tickets along M inside a minibatch's block (0: all).
    if (const char* gm = std::getenv("MOK_MK_GROUP_M")) ps.group_m = std::max(0, std::atoi(gm));
    if (profile) {
      stats = DeviceBuffer(static_cast<size_t>(sms) * mk::kForwardStatWords * 8, "megakernel profile");
      MOK_CUDA_CHECK(cudaMemset(stats.p, 0, static_cast<size_t>(sms) * mk::kForwardStatWords * 8));
      mkp.stats = stats.get<unsigned long long>();
    }
    mkp.schedule = schedule->view();
    mkp.x_peers = x_peers.get<const void* const>();
    mkp.combine_peers = combine_peers.get<void* const>();
    mkp.x_ring = x_ring;
    mkp.y_ring = y.p;
    mkp.hidden = static_cast<int32_t>(H);
    mkp.inter = static_cast<int32_t>(I);
    mkp.shared_inter = static_cast<int32_t>(Is);
    mkp.top_k = static_cast<int32_t>(k);
    mkp.tokens = static_cast<int32_t>(T);
    mkp.combine_in_epilogue = config.combine == CombinePath::Fc2Epilogue ? 1 : 0;
    using gemm::make_map_2d;
    using gemm::make_map_3d;
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    maps.x_ring = make_map_2d(x_ring, u(R), u(H), 128);
    maps.w1p = make_map_3d(w1p.p, u(e_loc), u(2 * I), u(H), kBN);
    maps.gu = make_map_2d(gu.p, u(std::max<int64_t>(cap_rows, sched::kBlockM)), u(2 * I), 64);
    maps.h_out = make_map_2d(h.p, u(R), u(I), 64);
    maps.h_in = make_map_2d(h.p, u(R), u(I), 128);
    maps.w_down = make_map_3d(weights.w_down, u(e_loc), u(H), u(I), kBN);
    maps.w1p_half = make_map_3d(w1p.p, u(e_loc), u(2 * I), u(H), kBN / 2);
    maps.w_down_half = make_map_3d(weights.w_down, u(e_loc), u(H), u(I), kBN / 2);
    maps.y_out = make_map_2d(y.p, u(R), u(H), 64);
    if (has_shared) {
      const int64_t rows = t_tiles * sched::kBlockM;
      maps.xs_in = make_map_2d(win_x->ptr, u(rows), u(H), 128);
      maps.ws1p = make_map_3d(ws1p.p, 1, u(2 * Is), u(H), kBN);
      maps.gus_out = make_map_2d(gu_s.p, u(rows), u(2 * Is), 64);
      maps.hs_out = make_map_2d(h_s.p, u(rows), u(Is), 64);
      maps.hs_in = make_map_2d(h_s.p, u(rows), u(Is), 128);
      maps.ws_down = make_map_3d(weights.ws_down, 1, u(H), u(Is), kBN);
      maps.ws1p_half = make_map_3d(ws1p.p, 1, u(2 * Is), u(H), kBN / 2);
      maps.ws_down_half = make_map_3d(weights.ws_down, 1, u(H), u(Is), kBN / 2);
      maps.ys_out = make_map_2d(y_s.p, u(rows), u(H), 64);
    } else {
      // Never used (no shared tasks); every map must still be a valid encoding.
      maps.xs_in = maps.ws1p = maps.gus_out = maps.hs_out = maps.hs_in = maps.ws_down = maps.ys_out = maps.x_ring;
      maps.ws1p_half = maps.ws_down_half = maps.x_ring;
    }
  }

  // Push dispatch: every receiver's schedule (from the same published routing, so bitwise the
  // receiver's own), and the peers' rings and counter blocks.
  void setup_push_dispatch() {
    std::vector<gpu::ScheduleView> views(static_cast<size_t>(world));
    std::vector<void*> rings(static_cast<size_t>(world));
    std::vector<uint32_t*> ctrs(static_cast<size_t>(world));
    receivers.resize(static_cast<size_t>(world));
    for (int d = 0; d < world; ++d) {
      if (d != rank)
        receivers[static_cast<size_t>(d)] =
            std::make_unique<gpu::ScheduleBuilder>(shape, config, d, tables.get<const int32_t* const>());
      views[static_cast<size_t>(d)] = d == rank ? schedule->view() : receivers[static_cast<size_t>(d)]->view();
      rings[static_cast<size_t>(d)] = comm::dev::lsa_pointer(comm, *win_ring, d);
      ctrs[static_cast<size_t>(d)] = static_cast<uint32_t*>(comm::dev::lsa_pointer(comm, *win_counters, d));
    }
    dest_views = upload_array(views, "receivers' schedules");
    ring_peers = upload_array(rings, "ring peers");
    counter_peers = upload_array(ctrs, "counter peers");
    mkp.push_dispatch = 1;
    mkp.dest_schedules = dest_views.get<const gpu::ScheduleView>();
    mkp.ring_peers = ring_peers.get<void* const>();
    mkp.counter_peers = counter_peers.get<uint32_t* const>();
  }

  void repack(cudaStream_t stream) {
    gemm::pack_gate_up(weights.w_gate, weights.w_up, w1p.p, e_loc, I, H, stream);
    if (Is > 0 && T > 0) gemm::pack_gate_up(weights.ws_gate, weights.ws_up, ws1p.p, 1, Is, H, stream);
  }

  gpu::MoveArgs move_args() const {
    gpu::MoveArgs a;
    a.schedule = schedule->view();
    a.hidden = H;
    a.top_k = k;
    a.sms = config.resolved_fwd_comm_sms(shape);
    return a;
  }

  void forward(const RoutingRefs& in, void* out, cudaStream_t stream, bool save_for_backward) {
    validate_routing_layout(shape, rank, in);
    MOK_REQUIRE(out != nullptr || T == 0, "out", "must be a [T, H] bf16 device buffer");
    if (T > 0 && in.x.data != win_x->ptr)  // x written into input_buffer(): nothing to copy
      MOK_CUDA_CHECK(cudaMemcpyAsync(win_x->ptr, in.x.data, static_cast<size_t>(T * H) * 2,
                                     cudaMemcpyDeviceToDevice, stream));
    // The megakernel's counters are zeroed before the barrier: with push dispatch the other ranks
    // count rows into them (and read them) as soon as they are past it. Nobody else touches them
    // between the previous call's final barrier and this one.
    if (fused) MOK_CUDA_CHECK(cudaMemsetAsync(mkp.counters, 0, static_cast<size_t>(mkp.layout.words()) * 4, stream));
    gpu::publish_routing(in.topk_idx.data, in.topk_idx.dtype == DType::I64, T, k, shape.experts,
                         rank, static_cast<int32_t*>(win_routing->ptr), errors.device(), stream);
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // routing, x and zeroed counters visible to every rank
    MOK_CUDA_CHECK(cudaGetLastError());
    schedule->build(stream);
    for (const auto& b : receivers)
      if (b) b->build(stream);
    saved = save_for_backward;
    if (fused) {
      mk::ForwardParams params = mkp;
      params.save_gu = save_for_backward ? 1 : 0;
      mk::launch_forward(maps, params, dc, grid, stream);
    } else {
      gpu::pull_dispatch(move_args(), x_peers.get<const void* const>(), x_routed.p, stream);
      gemm::run(save_for_backward ? fc1 : fc1_nogu, stream);
      gemm::run(fc2, stream);
      gpu::push_combine(move_args(), y.p, combine_peers.get<void* const>(), stream);
    }
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // every push into our combine slots landed
    MOK_CUDA_CHECK(cudaGetLastError());
    if (!fused && Is > 0 && T > 0) {
      gemm::run(save_for_backward ? fc1_s : fc1_s_nogu, stream);
      gemm::run(fc2_s, stream);
    }
    gpu::MergeArgs m;
    m.shared = (Is > 0 && T > 0) ? y_s.p : nullptr;
    m.slots = win_combine->ptr;
    m.weights = static_cast<const float*>(in.topk_w.data);
    m.topk_idx = in.topk_idx.data;
    m.idx_is_int64 = in.topk_idx.dtype == DType::I64;
    m.tokens = T;
    m.top_k = k;
    m.hidden = H;
    m.out = out;
    gpu::merge_forward(m, stream);
  }

  // ---------------------------------------------------------------------------------------------
  // Backward (unfused). Buffers it reuses from the forward: gu (d_gu is written over it), h (for
  // dW_down), the routed x rows (for dW_gate, dW_up), y (the routed d_x rows), the shared expert's
  // gu_s, h_s and y_s likewise, and the combine window (y_j for the router-weight gradient, then
  // the reverse-dispatch slots). Its own: dy_routed.
  void backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& g, cudaStream_t stream) {
    validate_routing_layout(shape, rank, in);
    validate_grad_output_layout(shape, rank, d_out);
    MOK_REQUIRE(saved, "forward(save_for_backward)",
                "backward() needs the last forward() to have saved the gate/up pre-activations "
                "(save_for_backward = true), and runs once per forward (it overwrites them with d_gu "
                "and the combine slots with d_x rows)");
    MOK_REQUIRE(!fused || ring_rows >= cap_rows, "config.macrobatch_tokens",
                "backward() reads every routed row of the forward, but the megakernel's ring holds ", ring_rows,
                " of up to ", cap_rows, " rows: use 0 (automatic) or at least the worst case, or "
                "config.forward_path = Unfused");
    MOK_REQUIRE(g.d_w_gate && g.d_w_up && g.d_w_down, "grads", "d_w_gate, d_w_up and d_w_down must be given");
    MOK_REQUIRE(T == 0 || (g.d_x && g.d_topk_w), "grads", "d_x and d_topk_w must be given when T > 0");
    MOK_REQUIRE(Is == 0 || T == 0 || (g.d_ws_gate && g.d_ws_up && g.d_ws_down), "grads",
                "d_ws_gate, d_ws_up and d_ws_down must be given when Is > 0");
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
      MOK_CUDA_CHECK(cudaMemcpyAsync(win_weights->ptr, in.topk_w.data, static_cast<size_t>(T * k) * 4,
                                     cudaMemcpyDeviceToDevice, stream));
      // Before the barrier: after it the peers' reverse-dispatch pushes overwrite the slots.
      gpu::RouterGradArgs rg;
      rg.d_out = win_dout->ptr;
      rg.y_slots = win_combine->ptr;
      rg.topk_idx = in.topk_idx.data;
      rg.idx_is_int64 = in.topk_idx.dtype == DType::I64;
      rg.tokens = T;
      rg.top_k = k;
      rg.hidden = H;
      rg.d_topk_w = g.d_topk_w;
      gpu::router_weight_grad(rg, stream);
    }
    mark(1, stream);
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // d_out and weights visible; every y_j read
    MOK_CUDA_CHECK(cudaGetLastError());
    mark(2, stream);
    const gpu::ScheduleView v = schedule->view();
    const int64_t tiles = cap_rows / sched::kBlockM;
    // The movement kernels run alone here (nothing to share the GPU with): every SM. With the
    // forward's comm SM count (8 at DeepSeek-V3) the pull took 5.9 ms and the push 3.2 ms of a
    // 31 ms backward (MOK_PROFILE, 2 H200s, T = 8192): ~160 and ~290 GB/s for 0.94 GB each.
    gpu::MoveArgs move = move_args();
    move.sms = sms;
    gpu::pull_reverse_combine(move, dout_peers.get<const void* const>(), weight_peers.get<const float* const>(),
                              dy_routed.p, stream);
    mark(3, stream);
    // Routed d_x rows into y (the forward's FC2 output is no longer needed).
    run_dgrads(dy_routed.p, weights.w_down, gu.p, w1p.p, y.p, I, e_loc, v.tile_expert, tiles, stream, 4);
    mark(5, stream);
    gpu::push_combine(move, y.p, combine_peers.get<void* const>(), stream);
    mark(6, stream);
    // Weight gradients while the pushes land: rows in the schedule's order, padding rows masked.
    if (cap_rows > 0) {
      run_wgrad(dy_routed.p, h.p, g.d_w_down, H, I, e_loc, cap_rows, v.expert_offset, v.expert_rows, stream);
      mark(7, stream);
      run_wgrad(gu.p, x_rows, g.d_w_gate, 2 * I, H, e_loc, cap_rows, v.expert_offset, v.expert_rows, stream,
                g.d_w_up);
    } else {  // no rank has tokens: no rows, zero gradients
      for (void* p : {g.d_w_gate, g.d_w_up, g.d_w_down})
        MOK_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(e_loc * I * H) * 2, stream));
      mark(7, stream);
    }
    mark(8, stream);
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // every d_x row pushed into our slots landed
    MOK_CUDA_CHECK(cudaGetLastError());
    mark(9, stream);
    bwd_marked = marking && !bwd_marks.empty();
    if (T == 0) {  // no tokens: the shared expert's gradient over them is zero
      for (void* p : {g.d_ws_gate, g.d_ws_up, g.d_ws_down})
        if (Is > 0 && p != nullptr) MOK_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(Is * H) * 2, stream));
      mark(10, stream);
      mark(11, stream);
      return;
    }
    if (Is > 0) shared_backward(g, stream);
    mark(10, stream);
    gpu::MergeArgs m;
    m.shared = Is > 0 ? y_s.p : nullptr;
    m.slots = win_combine->ptr;
    m.topk_idx = in.topk_idx.data;
    m.idx_is_int64 = in.topk_idx.dtype == DType::I64;
    m.tokens = T;
    m.top_k = k;
    m.hidden = H;
    m.out = g.d_x;
    gpu::merge_backward(m, stream);
    mark(11, stream);
  }

  std::string forward_profile() const;  // the megakernel's line of profile_summary, or ""

  // The last backward's stage times (MOK_PROFILE=1), or "".
  std::string backward_profile() const {
    if (!bwd_marked) return "";
    MOK_CUDA_CHECK(cudaEventSynchronize(bwd_marks.back()));
    std::string line = "backward stages (ms):";
    float total = 0;
    for (int i = 0; i < kBwdStages; ++i) {
      float ms = 0;
      MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, bwd_marks[static_cast<size_t>(i)], bwd_marks[static_cast<size_t>(i + 1)]));
      total += ms;
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s %s %.3f", i ? "," : "", kBwdStageNames[i], ms);
      line += buf;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "; total %.3f", total);
    return line + buf;
  }

  // The shared expert over this rank's tokens: dy = d_out (weight 1), as one expert of T rows.
  void shared_backward(const DeviceGrads& g, cudaStream_t stream) {
    const int32_t* begin = shared_rows.get<const int32_t>();
    run_dgrads(win_dout->ptr, weights.ws_down, gu_s.p, ws1p.p, y_s.p, Is, 1, shared_tiles.get<const int32_t>(),
               t_tiles, stream);
    run_wgrad(win_dout->ptr, h_s.p, g.d_ws_down, H, Is, 1, t_tiles * sched::kBlockM, begin, begin + 1, stream);
    run_wgrad(gu_s.p, win_x->ptr, g.d_ws_gate, 2 * Is, H, 1, t_tiles * sched::kBlockM, begin, begin + 1, stream,
              g.d_ws_up);
  }

  // The dgrads of a group of experts: d_gu = SwiGLU'(gu, rnd(dy . w_down)) written over gu, then
  // the d_x rows = rnd(d_gu . w1p) into dx_rows; mark_between >= 0 records that stage mark between.
  void run_dgrads(const void* dy, const void* w_down, void* gu_buf, const void* w1p_buf, void* dx_rows, int64_t inter,
                  int64_t experts, const int32_t* tile_expert, int64_t tiles, cudaStream_t stream,
                  int mark_between = -1) {
    gemm::DgradSwiGLUArgs ds;
    ds.dy = dy;
    ds.w_down = w_down;
    ds.gu = gu_buf;
    ds.d_gu = gu_buf;
    ds.hidden = H;
    ds.inter = inter;
    ds.experts = experts;
    ds.tile_expert = tile_expert;
    ds.num_m_tiles = tiles;
    gemm::run(gemm::plan_dgrad_swiglu(ds), stream);
    if (mark_between >= 0) mark(mark_between, stream);
    gemm::DgradArgs dx;
    dx.dy = gu_buf;
    dx.w = w1p_buf;
    dx.dx = dx_rows;
    dx.k = 2 * inter;
    dx.n = H;
    dx.experts = experts;
    dx.tile_expert = tile_expert;
    dx.num_m_tiles = tiles;
    gemm::run(gemm::plan_dgrad(dx), stream);
  }

  // dw[e] = a_e^T b_e over expert e's rows (K-grouped wgrad; the plan encodes the output pointers).
  // dw_up: a is packed gate/up (d_gu), dw gets the gate rows and dw_up the up rows.
  static void run_wgrad(const void* a, const void* b, void* dw, int64_t m, int64_t n, int64_t experts,
                        int64_t rows_total, const int32_t* row_begin, const int32_t* rows, cudaStream_t stream,
                        void* dw_up = nullptr) {
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
    gemm::run(gemm::plan_wgrad(w), stream);
  }

  void allocate_backward() {
    if (dy_routed.p != nullptr) return;
    if (profile && bwd_marks.empty()) {
      for (int i = 0; i <= kBwdStages; ++i) {
        cudaEvent_t e = nullptr;
        MOK_CUDA_CHECK(cudaEventCreate(&e));
        bwd_marks.push_back(e);
      }
    }
    dy_routed = DeviceBuffer(static_cast<size_t>(cap_rows * H) * 2, "backward dy rows");
    if (Is > 0 && T > 0) {
      // The shared expert as one expert of T rows starting at row 0: {begin, rows}.
      shared_rows = upload_array(std::vector<int32_t>{0, static_cast<int32_t>(T)}, "shared expert rows");
      if (shared_tiles.p == nullptr)  // the megakernel path has no shared tile table
        shared_tiles = upload_array(std::vector<int32_t>(static_cast<size_t>(t_tiles), 0), "shared tiles");
    }
  }
};

Layer::Layer(comm::Communicator& comm, const LayerShape& shape, const Config& config,
             const DeviceWeights& weights)
    : impl_(std::make_unique<Impl>(comm, shape, config, weights)) {}

Layer::~Layer() = default;

void Layer::forward(const RoutingRefs& in, void* out, cudaStream_t stream, bool save_for_backward) {
  impl_->forward(in, out, stream, save_for_backward);
}

void Layer::backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& grads, cudaStream_t stream) {
  impl_->backward(in, d_out, grads, stream);
}

void Layer::repack(cudaStream_t stream) { impl_->repack(stream); }

void* Layer::input_buffer() const { return impl_->T > 0 ? impl_->win_x->ptr : nullptr; }

std::string Layer::profile_summary() const {
  const std::string fwd = impl_->forward_profile(), bwd = impl_->backward_profile();
  return fwd.empty() || bwd.empty() ? fwd + bwd : fwd + "\n" + bwd;
}

std::string Layer::Impl::forward_profile() const {
  const Impl& m = *this;
  if (m.stats.p == nullptr) return "";
  std::vector<unsigned long long> w(static_cast<size_t>(m.sms) * mk::kForwardStatWords);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  MOK_CUDA_CHECK(cudaMemcpy(w.data(), m.stats.p, w.size() * 8, cudaMemcpyDeviceToHost));
  const int c = m.mkp.plan.comm_ctas;
  double span = 0, busy = 0, wait = 0, dep = 0, tiles = 0, cspan = 0, pull = 0, push = 0, idle = 0, max_span = 0;
  double start = 0, epi = 0, fc2 = 0, fc2_tiles = 0, mc_tiles = 0, cycles = 0;
  for (int b = 0; b < m.grid; ++b) {
    const unsigned long long* s = &w[static_cast<size_t>(b) * mk::kForwardStatWords];
    max_span = std::max(max_span, double(s[0]));
    if (b < c) {
      cspan += double(s[0]);
      pull += double(s[1]);
      push += double(s[2]);
      idle += double(s[3]);
    } else {
      span += double(s[0]);
      busy += double(s[1]);
      wait += double(s[2]);
      dep += double(s[3]);
      tiles += double(s[4]);
      start += double(s[5]);
      epi += double(s[6]);
      fc2 += double(s[7]);
      fc2_tiles += double(s[8]);
      mc_tiles += double(s[9]);
      cycles += double(s[10]);
    }
  }
  const auto pct = [](double a, double b) { return b > 0 ? 100.0 * a / b : 0.0; };
  const auto per_tile_us = [](double ns, double n) { return n > 0 ? ns / n * 1e-3 : 0.0; };
  // With clusters only rank 0's producer claims tasks and waits for dependencies.
  const double dep_span = m.mkp.cluster ? span / 2 : span;
  char pairs[96] = "";
  if (m.mkp.cluster)
    std::snprintf(pairs, sizeof pairs, ", B multicast for %.1f%% of the tiles", pct(mc_tiles, tiles));
  char line[896];
  std::snprintf(line, sizeof line,
                "kernel %.3f ms, SM clock %.2f GHz (compute CTAs' average); %d compute CTAs: busy %.1f%% (of it: first stage of a tile %.1f%%, epilogues "
                "%.1f%%), waiting for a task %.1f%%, producer on dependencies %.1f%%, %.1f tiles/CTA, %.1f us/tile "
                "(FC2 %.1f, others %.1f)%s; %d comm CTAs: pull %.1f%%, push %.1f%%, idle %.1f%%",
                max_span * 1e-6, span > 0 ? cycles / span : 0.0, m.grid - c, pct(busy, span), pct(start, span), pct(epi, span), pct(wait, span),
                pct(dep, dep_span), tiles / std::max(1, m.grid - c), per_tile_us(busy, tiles),
                per_tile_us(fc2, fc2_tiles), per_tile_us(busy - fc2, tiles - fc2_tiles), pairs, c, pct(pull, cspan),
                pct(push, cspan), pct(idle, cspan));
  return line;
}

void Layer::check() {
  // Expired waits: cross-rank ones (with a record naming the wait and the peer) and the
  // kernels' internal pipeline waits (claim word only); either poisons the communicator.
  impl_->comm.check_waits();
  impl_->errors.check(impl_->k);
}

}  // namespace mok
