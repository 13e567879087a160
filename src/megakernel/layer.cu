// The GPU layer of one rank: construction (windows, buffers, plans, the cross-rank agreement),
// the forward on both paths (see include/mok/layer.hpp for the sequence and its synchronization
// argument), the checks every call makes, and the profile line. The backward is in
// layer_backward.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "common/env_flag.h"
#include "common/device_check.h"
#include "gemm/tensor_map.h"
#include "megakernel/forward_setup.h"
#include "megakernel/layer_impl.h"
#include "megakernel/merge.h"
#include "schedule/schedule_math.h"

namespace mok {

namespace {

// One CTA at an LSA barrier of the layer's communicator. After a failure (some rank's abort word
// set) it never arrives: a peer must not get past a barrier this rank did not really reach. A
// failure only this GPU saw (a kernel-internal pipeline wait) is told to every peer here first.
__global__ void barrier_kernel(__grid_constant__ const comm::dev::DeviceComm dc, uint32_t index) {
  if (comm::dev::entry_aborted(dc)) {
    if (threadIdx.x == 0) {
      const uint32_t code = comm::dev::abort_code(dc);
      if (comm::abort_origin(code, dc.rank) == dc.rank)
        comm::dev::broadcast_abort(dc, comm::abort_has_origin(code) ? code : comm::encode_abort(dc.rank, code));
    }
    return;
  }
  comm::dev::lsa_barrier(dc, index);
}

}  // namespace

using layer_detail::upload_array;

Layer::Impl::~Impl() {
  int prev = -1;
  const bool restore = cudaGetDevice(&prev) == cudaSuccess;
  if (cudaSetDevice(comm.device()) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    leases.keep = true;
    for (auto& w : shared_windows) w->keep = true;
  }
  for (cudaEvent_t e : bwd_marks) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : win_marks) (void)cudaEventDestroy(e);
  if (restore) (void)cudaSetDevice(prev);
}

Layer::Impl::Impl(comm::Communicator& c, const LayerShape& s, const Config& cfg, const DeviceWeights& w)
    : comm(c), shape(s), config(cfg), weights(w) {
  register_site_names();
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()));
  fused = config.forward_path == ForwardPath::Megakernel;
  read_knobs();
  rank = comm.rank();
  world = comm.world_size();
  // This rank's own checks first. Their verdict is one field of the cross-rank agreement below:
  // a rank that refuses its arguments must not leave the others waiting in a collective (they
  // would time out after CommOptions::bootstrap_timeout_s, naming the wrong thing), so every rank
  // takes part in the agreement and then raises: the refusing rank its own error, the others one
  // naming the rank whose arguments were refused.
  std::exception_ptr refused;
  mk::ForwardSetup fs;
  std::vector<comm::HandshakeField> resolved;
  try {
    config.validate(shape, sms);
    MOK_REQUIRE(world == shape.world_size(), "shape.tokens",
                "one entry per rank of the communicator is required (communicator has ", world,
                " ranks, shape has ", shape.world_size(), ")");
    H = shape.hidden;
    I = shape.intermediate;
    k = shape.top_k;
    e_loc = shape.local_experts();
    Is = shape.shared_intermediate;
    T = shape.tokens_of(rank);
    check_precision();
    fp8 = config.precision != Precision::BF16;
    mx = config.precision == Precision::MXFP8;
    validate_weights_layout(shape, w);
    check_device_weight_set("weights.w", w.w_gate, w.w_up, w.w_down, w.ws_gate, w.ws_up, w.ws_down, Is > 0,
                            comm.device());
    if (fused) {
      fs = mk::plan_forward(shape, config, rank, sms);
      MOK_REQUIRE(H <= mk::forward_max_hidden(), "shape.hidden",
                  "the megakernel's comm CTAs stage whole rows in shared memory: at most ",
                  mk::forward_max_hidden(), ", got ", H);
    }
    // What the config resolves to with this device's SM count: push dispatch builds the
    // receivers' schedules with the sender's minibatch and ring, so no rank may differ.
    resolved = {{"resolved.minibatch_rows", config.resolved_minibatch(shape, sms), false},
                {"resolved.macrobatch_rows", config.resolved_macrobatch(shape, sms), false},
                {"resolved.fwd_comm_sms", config.resolved_fwd_comm_sms(shape), false}};
    mem = plan_memory(shape, config, rank, sms);  // every size below (include/mok/memory.hpp)
    if (config.share_workspace)  // whether each shared window is reused or taken (a collective) alike
      resolved.push_back({"workspace.windows_reused", Workspace::of(comm)->windows_reused(mem), false});
  } catch (...) {
    refused = std::current_exception();
  }
  // The layer's shape and config must be the same on every rank (push dispatch even builds the
  // receivers' schedules from the sender's): compared before any window is taken, so a mismatch
  // is named on every rank instead of corrupting results. cpu_threads is host-only.
  int nccl_version = 0;
  (void)ncclGetVersion(&nccl_version);
  std::vector<comm::HandshakeField> fields;
  fields.push_back({"arguments accepted by every rank (0: that rank refused them, see its error)",
                    refused ? 0 : 1, false});
  if (!refused) {
    for (auto& f : comm::handshake_fields(shape, config, {}, world, comm.options().lsa_barrier_count, nccl_version))
      fields.push_back(std::move(f));
    fields.insert(fields.end(), resolved.begin(), resolved.end());
  }
  for (auto& f : fields) f.name = "layer " + f.name;
  try {
    comm.agree(fields);
  } catch (...) {
    if (refused) std::rethrow_exception(refused);
    throw;
  }
  if (refused) std::rethrow_exception(refused);  // every rank refused: each raises its own

  // Symmetric windows, equal on every rank (sized by the largest T), taken from the
  // communicator's pool when an earlier layer gave back one that fits, all of them before any
  // local allocation (a local failure after this point leaves no rank inside a collective).
  // Names carry the number of windows already registered so several layers can share one
  // communicator.
  layer_number = static_cast<int64_t>(comm.window_count());
  const std::string tag = "mok.layer" + std::to_string(layer_number);
  if (config.share_workspace) workspace = Workspace::of(comm);
  const auto bytes = [&](const char* name) { return static_cast<size_t>(mem.bytes(name)); };
  win_routing = acquire_window(tag, "window.routing");
  win_x = acquire_window(tag, "window.x");
  x_window_shared = !shared_windows.empty() && shared_windows.back()->window == win_x;
  win_combine = acquire_window(tag, "window.combine");
  win_dout = acquire_window(tag, "window.d_out");
  win_weights = acquire_window(tag, "window.router_weights");
  win_dweights = acquire_window(tag, "window.d_weights");
  push = fused && config.dispatch == DispatchPath::Push;
  if (push) {
    // Other ranks write into our ring and count into our counters: symmetric windows (equal on
    // every rank: R is, and the counters are sized for the largest T).
    win_ring = leases.acquire(comm, tag + ".ring", bytes("x_ring"));
    win_counters = leases.acquire(comm, tag + ".counters", bytes("counters"));
  }
  dc = comm::dev::make_device_comm(comm);
  std::vector<const void*> tab(world), xp(world), dp(world), wp(world);
  std::vector<void*> cp(world), dwp(world);
  std::vector<const void*> callp(world);
  for (int r = 0; r < world; ++r) {
    dwp[r] = comm::dev::lsa_pointer(comm, *win_dweights, r);
    callp[r] = static_cast<const char*>(comm::dev::lsa_pointer(comm, *win_weights, r)) +
               router_call_offset(shape.max_tokens(), k);
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
  dweight_peers = upload_array(dwp, "router weight gradient peers");
  call_peers = upload_array(callp, "backward id peers");
  schedule = std::make_unique<gpu::ScheduleBuilder>(shape, config, rank, tables.get<const int32_t* const>(), sms);

  cap_rows = shape.worst_case_rows();
  t_tiles = sched::ceil_div(T, sched::kBlockM);
  // gate/up pre-activations of every routed row (kept for backward on both paths). Not written
  // by forward(..., save_for_backward = false): a backward must know whether the last forward
  // saved them (track it when the backward lands; a captured graph fixes the flag).
  // (at least one tile of rows, so tensor maps stay valid when no rank has tokens)
  // (The FP8 megakernel's resident ring: forward only, nothing saved; over windows gu holds a
  // window's gate/up rows of FC1 again, gu_saved the activation budget's.)
  if (!fp8 || !fused || fs.windowed) gu = allocate("gu", "gu");
  const bool has_shared = Is > 0 && T > 0;
  if (has_shared) {
    gu_s = DeviceBuffer(bytes("gu_s"), "gu_s");
    h_s = DeviceBuffer(bytes("h_s"), "h_s");
    y_s = allocate("y_s", "y_s");
  }
  if (fused)
    setup_megakernel(fs);
  else
    setup_unfused();
  setup_saved_slots();
  bind_weights();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

// Unfused path: routed buffers for the worst case (one macrobatch); bind_weights builds one GEMM
// plan per stage.
void Layer::Impl::setup_unfused() {
  x_routed = allocate("x_routed", "x_routed");
  x_rows = x_routed.p;
  h = allocate("h", "h");
  y = allocate("y", "y");
  if (Is > 0 && T > 0)
    shared_tiles = upload_array(std::vector<int32_t>(static_cast<size_t>(t_tiles), 0), "shared tiles");
}

gemm::Fc1Args Layer::Impl::routed_fc1(const void* x, void* h_rows, void* gu_rows, const int32_t* tile_expert,
                                      int64_t tiles) const {
  gemm::Fc1Args a;
  a.x = x;
  a.w_gate = weights.w_gate.data;
  a.w_up = weights.w_up.data;
  a.h = h_rows;
  a.gu = gu_rows;
  a.hidden = H;
  a.inter = I;
  a.experts = e_loc;
  a.tile_expert = tile_expert;
  a.num_m_tiles = tiles;
  return a;
}

// The unfused path's GEMM plans: FC1 reads w_gate and w_up where the caller keeps them.
void Layer::Impl::plan_unfused() {
  const gpu::ScheduleView v = schedule->view();
  gemm::Fc1Args a1 = routed_fc1(x_routed.p, h.p, gu.p, v.tile_expert, cap_rows / sched::kBlockM);
  a1.expert_row_begin = v.expert_offset;  // nearly empty tiles in split-N form
  a1.expert_rows = v.expert_rows;
  fc1 = gemm::plan_fc1(a1, gemm_options());
  gemm::Fc1Args a1_nogu = a1;  // forward(..., save_for_backward = false)
  a1_nogu.gu = nullptr;
  fc1_nogu = gemm::plan_fc1(a1_nogu, gemm_options());
  gemm::Fc2Args a2;
  a2.a = h.p;
  a2.w = weights.w_down.data;
  a2.y = y.p;
  a2.k = I;
  a2.n = H;
  a2.experts = e_loc;
  a2.tile_expert = v.tile_expert;
  a2.num_m_tiles = cap_rows / sched::kBlockM;
  a2.expert_row_begin = v.expert_offset;
  a2.expert_rows = v.expert_rows;
  fc2 = gemm::plan_fc2(a2, gemm_options());
  // Shared expert: one "expert" over this rank's tokens, read straight from the x window.
  if (Is > 0 && T > 0) {
    gemm::Fc1Args s1 = a1;
    s1.x = win_x->ptr;
    s1.w_gate = weights.ws_gate.data;
    s1.w_up = weights.ws_up.data;
    s1.h = h_s.p;
    s1.gu = gu_s.p;
    s1.inter = Is;
    s1.experts = 1;
    s1.tile_expert = shared_tiles.get<const int32_t>();
    s1.num_m_tiles = t_tiles;
    s1.expert_row_begin = s1.expert_rows = nullptr;  // one "expert": no split-N
    fc1_s = gemm::plan_fc1(s1, gemm_options());
    s1.gu = nullptr;
    fc1_s_nogu = gemm::plan_fc1(s1, gemm_options());
    gemm::Fc2Args s2 = a2;
    s2.a = h_s.p;
    s2.w = weights.ws_down.data;
    s2.y = y_s.p;
    s2.k = Is;
    s2.experts = 1;
    s2.tile_expert = shared_tiles.get<const int32_t>();
    s2.num_m_tiles = t_tiles;
    s2.expert_row_begin = s2.expert_rows = nullptr;
    fc2_s = gemm::plan_fc2(s2, gemm_options());
  }
}

// Megakernel: the ring (macrobatch) buffers, the counter block and the tensor maps of the buffers
// (bind_weights adds the weights').
void Layer::Impl::setup_megakernel(const mk::ForwardSetup& fs) {
  const int64_t R = fs.ring_rows;
  void* x_ring = nullptr;
  if (push) {
    // The ring window (acquired with the others): kernels reach it through NCCL's flat alias
    // only (as the peers do; see comm/device.cuh).
    x_ring = comm::dev::lsa_pointer(comm, *win_ring, rank);
  } else {
    x_routed = allocate("x_ring", "x ring");
    x_ring = x_routed.p;
  }
  x_rows = x_ring;
  ring_rows = R;
  windowed = fs.windowed;  // the backward runs over windows of the ring (layer_backward_windows.cu)
  saved_rows = fs.saved_rows;
  if (saved_rows > 0) gu_saved = allocate("gu_saved", "saved gate/up rows");
  h = allocate("h_ring", "h ring");
  y = allocate("y_ring", "y ring");
  mkp.plan = fs.plan;
  mkp.layout = fs.layout;
  mkp.cluster = fs.cluster ? 1 : 0;
  mk::PlanShape& ps = mkp.plan;
  const bool has_shared = ps.s_tiles > 0;
  if (push) {
    // The counter window (acquired with the others; the shared expert's words, the last ones,
    // sized for the largest T). The flat alias, which the peers' and our own comm CTAs' remote
    // adds also use.
    mkp.counters = static_cast<uint32_t*>(comm::dev::lsa_pointer(comm, *win_counters, rank));
    setup_push_dispatch();
  } else {
    counters = DeviceBuffer(static_cast<size_t>(mem.bytes("counters")), "megakernel counters");
    mkp.counters = counters.get<uint32_t>();
  }
  grid = mx    ? mk::mxfp8::prepare_forward(ps.comm_ctas, sms, false)
         : fp8 ? mk::fp8::prepare_forward(ps.comm_ctas, sms, false)
               : mk::prepare_forward(ps.comm_ctas, sms, mkp.cluster != 0);
  if (mkp.cluster) {
    MOK_REQUIRE(mem.bytes("cluster_slots") >= mk::forward_cluster_slot_bytes(grid), "memory plan",
                "cluster_slots must hold the grid's clusters' task slots");
    cluster_slots = allocate("cluster_slots", "cluster task slots");
    mkp.cluster_slots = cluster_slots.p;
  }
  // Experiment knob (not API): MOK_MK_SKEW=1..4 staggers the consumer warpgroups so one's
  // epilogue overlaps the other's MMAs (see the engine's Skew); bf16 only (the FP8 program has none).
  if (const char* sk = std::getenv("MOK_MK_SKEW")) mkp.skew_stages = std::clamp(std::atoi(sk), 0, 4);
  // MOK_MK_SPLIT_N=0: tiles with <= 64 token rows on warpgroup 0 alone (A/B of the split-N form).
  if (const char* sn = std::getenv("MOK_MK_SPLIT_N")) mkp.split_n = std::atoi(sn) != 0 ? 1 : 0;
  // MOK_MK_GROUP_M=n: raster groups of n tickets along M inside a minibatch's block (0: all).
  if (const char* gm = std::getenv("MOK_MK_GROUP_M")) ps.group_m = std::max(0, std::atoi(gm));
  // MOK_MK_MOVER_ROUNDS=1: the comm CTAs' movers in rounds (for racecheck; scripts/sanitize.sh).
  mkp.mover_rounds = env_flag("MOK_MK_MOVER_ROUNDS", false) ? 1 : 0;
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
  // Every routed row's, or with a backward over windows the activation budget's first rows (the
  // stores of rows past them clipped; unused with full recompute).
  if (windowed && saved_rows > 0)
    maps.gu = make_map_2d(gu_saved.p, u(saved_rows), u(2 * I), 64);
  else if (fp8)
    maps.gu = maps.x_ring;  // (never stored: the FP8 megakernel with a resident ring saves nothing)
  else
    maps.gu = make_map_2d(gu.p, u(mem.bytes("gu") / (4 * I)), u(2 * I), 64);
  maps.h_out = make_map_2d(h.p, u(R), u(I), 64);
  maps.h_in = make_map_2d(h.p, u(R), u(I), 128);
  maps.y_out = make_map_2d(y.p, u(R), u(H), 64);
  if (has_shared) {
    const int64_t rows = t_tiles * sched::kBlockM;
    maps.xs_in = make_map_2d(win_x->ptr, u(rows), u(H), 128);
    maps.gus_out = make_map_2d(gu_s.p, u(rows), u(2 * Is), 64);
    maps.hs_out = make_map_2d(h_s.p, u(rows), u(Is), 64);
    maps.hs_in = make_map_2d(h_s.p, u(rows), u(Is), 128);
    maps.ys_out = make_map_2d(y_s.p, u(rows), u(H), 64);
  } else {
    // Never used (no shared tasks); every map must still be a valid encoding.
    maps.xs_in = maps.gus_out = maps.hs_out = maps.hs_in = maps.ys_out = maps.x_ring;
  }
  if (fp8) setup_megakernel_fp8();
}

// receiver's own), and the peers' rings and counter blocks.
void Layer::Impl::setup_push_dispatch() {
  std::vector<gpu::ScheduleView> views(static_cast<size_t>(world));
  std::vector<void*> rings(static_cast<size_t>(world));
  std::vector<uint32_t*> ctrs(static_cast<size_t>(world));
  receivers.resize(static_cast<size_t>(world));
  for (int d = 0; d < world; ++d) {
    if (d != rank)
      receivers[static_cast<size_t>(d)] =
          std::make_unique<gpu::ScheduleBuilder>(shape, config, d, tables.get<const int32_t* const>(), sms);
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

// Everything that holds a weight's address: the unfused path's plans, or the megakernel's weight
// maps (FC1's B from w_gate and w_up as they are: no packed copy, so an optimizer's in-place
// update is read by the next call). Host-side only (tensor-map encodes): set_weights calls it too.
void Layer::Impl::bind_weights() {
  if (fp8) {  // the weights' codes, then the plans (unfused) or the maps (megakernel)
    bind_weights_fp8();
    return;
  }
  if (!fused) {
    plan_unfused();
    return;
  }
  using gemm::make_map_3d;
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  constexpr int64_t kBN = mk::kForwardBlockN;
  constexpr auto kBox = static_cast<uint32_t>(gemm::kGateUpGroup);
  maps.w_gate = make_map_3d(weights.w_gate.data, u(e_loc), u(I), u(H), kBox);
  maps.w_up = make_map_3d(weights.w_up.data, u(e_loc), u(I), u(H), kBox);
  maps.w_down = make_map_3d(weights.w_down.data, u(e_loc), u(H), u(I), kBN);
  maps.w_down_half = make_map_3d(weights.w_down.data, u(e_loc), u(H), u(I), kBN / 2);
  if (mkp.plan.s_tiles > 0) {
    maps.ws_gate = make_map_3d(weights.ws_gate.data, 1, u(Is), u(H), kBox);
    maps.ws_up = make_map_3d(weights.ws_up.data, 1, u(Is), u(H), kBox);
    maps.ws_down = make_map_3d(weights.ws_down.data, 1, u(H), u(Is), kBN);
    maps.ws_down_half = make_map_3d(weights.ws_down.data, 1, u(H), u(Is), kBN / 2);
  } else {
    // Never used (no shared tasks); every map must still be a valid encoding.
    maps.ws_gate = maps.ws_up = maps.ws_down = maps.ws_down_half = maps.w_gate;
  }
}

void Layer::Impl::set_weights(const DeviceWeights& w) {
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  validate_weights_layout(shape, w);
  check_device_weight_set("weights.w", w.w_gate, w.w_up, w.w_down, w.ws_gate, w.ws_up, w.ws_down, Is > 0,
                          comm.device());
  const DeviceWeights previous = weights;
  weights = w;
  try {
    bind_weights();
  } catch (...) {
    weights = previous;  // a refused encode leaves the layer as it was
    bind_weights();
    throw;
  }
}

gpu::MoveArgs Layer::Impl::move_args() const {
  gpu::MoveArgs a;
  a.schedule = schedule->view();
  a.hidden = H;
  a.top_k = k;
  a.sms = config.resolved_fwd_comm_sms(shape);
  a.abort = dc.claim;
  return a;
}

void Layer::Impl::register_site_names() {
  comm::register_wait_name(comm::kWaitUserBase + 40, "megakernel.task_dependency");
  comm::register_wait_name(comm::kWaitUserBase + 41, "megakernel.comm_dependency");
  for (const mk::WaitSite& site : mk::kWaitSites) comm::register_wait_name(site.code, site.name);
  comm::register_wait_name(gemm::kSiteFp8Segment, "gemm.fp8_segment_misaligned");
  comm::register_wait_name(gemm::kSiteHeldRows, "gemm.held_rows_past_the_hold");
}

gemm::Options Layer::Impl::gemm_options() const {
  gemm::Options o;
  o.error = dc.claim;
  o.wait_limit_s = config.wait_timeout_s;
  return o;
}

void Layer::Impl::barrier(cudaStream_t stream) {
  barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void Layer::Impl::check_routing(const RoutingRefs& in) const {
  validate_routing_layout(shape, rank, in);
  const int dev = comm.device();
  check_device_tensor("x", in.x, dev);
  check_device_tensor("topk_idx", in.topk_idx, dev, size_of(in.topk_idx.dtype));
  check_device_tensor("topk_w", in.topk_w, dev, 4);
}

int64_t Layer::Impl::forward(const RoutingRefs& in, const TensorRef& out, cudaStream_t stream, bool save_for_backward) {
  const layer_detail::CallScope scope(comm, stream, "forward()");
  check_routing(in);
  check_tensor("out", out, {DType::BF16}, {T, H});
  check_device_tensor("out", out, comm.device());
  MOK_REQUIRE(!fp8 || !fused || windowed || !save_for_backward, "save_for_backward",
              "must be false with config.precision fp8 / mxfp8 on the megakernel with a resident ring (its backward "
              "runs over windows of a ring below the worst case: config.workspace_budget_bytes, macrobatch_tokens; "
              "or the unfused path's FP8 forward trains)");
  MOK_REQUIRE(!fp8 || T == 0 || in.x.data != win_x->ptr, "x",
              "must not be input_buffer() with config.precision fp8 / mxfp8 (the window holds x's E4M3 codes, made "
              "from x)");
  // This forward's number; with several forwards alive, its slot's state becomes the members'
  // (every forward takes one, saved or not: it builds its schedule there). Host-side bookkeeping
  // that a replayed CUDA graph would not repeat: refused under capture.
  refuse_capture_with_slots(stream);
  const int64_t id = forwards++;
  if (slots.size() > 1) activate(static_cast<int>(id % static_cast<int64_t>(slots.size())));
  active_generation = id;
  saved = false;  // until this forward has enqueued everything: a throw below leaves nothing to use
  // One GPU, bf16 megakernel, no shared expert (its tiles read x through a map of the window): the
  // comm CTAs read the caller's x (16-byte aligned for their bulk copies); no 2 T H byte copy.
  x_from_caller = fused && !fp8 && shape.world_size() == 1 && Is == 0 && T > 0 && in.x.data != win_x->ptr &&
                  reinterpret_cast<uintptr_t>(in.x.data) % 16 == 0;
  if (fp8) {
    quantize_x_fp8(in.x.data, stream);  // x's codes and scales where the peers pull them
  } else if (T > 0 && in.x.data != win_x->ptr && !x_from_caller) {  // input_buffer(): nothing to copy
    MOK_CUDA_CHECK(cudaMemcpyAsync(win_x->ptr, in.x.data, static_cast<size_t>(T * H) * 2,
                                   cudaMemcpyDeviceToDevice, stream));
  }
  // The megakernel's counters are zeroed before the barrier: with push dispatch the other ranks
  // count rows into them (and read them) as soon as they are past it. Nobody else touches them
  // between the previous call's final barrier and this one.
  if (fused) MOK_CUDA_CHECK(cudaMemsetAsync(mkp.counters, 0, static_cast<size_t>(mkp.layout.words()) * 4, stream));
  gpu::publish_routing(in.topk_idx.data, in.topk_idx.dtype == DType::I64, static_cast<const float*>(in.topk_w.data),
                       T, k, shape.experts, rank, static_cast<int32_t*>(win_routing->ptr), errors.device(), stream);
  barrier(stream);  // routing, x and zeroed counters visible to every rank
  schedule->build(stream, dc.claim);
  for (const auto& b : receivers)
    if (b) b->build(stream, dc.claim);
  if (fused) {
    mk::ForwardParams params = mkp;
    params.schedule = schedule->view();  // the active slot's (several forwards alive)
    params.x_local = x_from_caller ? in.x.data : nullptr;
    // Windowed: the rows of the activation budget (none with full recompute: FC1 recomputed).
    params.save_gu = save_for_backward && (!windowed || saved_rows > 0) ? 1 : 0;
    params.save_gu_shared = save_for_backward ? 1 : 0;
    if (mx)
      mk::mxfp8::launch_forward(maps, params, dc, grid, stream);
    else if (fp8)
      mk::fp8::launch_forward(maps, params, dc, grid, stream);
    else
      mk::launch_forward(maps, params, dc, grid, stream);
  } else if (fp8) {
    routed_forward_fp8(stream, save_for_backward);
  } else {
    gpu::pull_dispatch(move_args(), x_peers.get<const void* const>(), x_routed.p, stream);
    gemm::run(save_for_backward ? fc1 : fc1_nogu, stream);
    gemm::run(fc2, stream);
    gpu::push_combine(move_args(), y.p, combine_peers.get<void* const>(), stream);
  }
  barrier(stream);  // every push into our combine slots landed
  if (!fused && Is > 0 && T > 0) {
    gemm::run(save_for_backward ? fc1_s : fc1_s_nogu, stream);
    gemm::run(fc2_s, stream);
  }
  // (topk_idx: the checked routing, where an invalid entry of the caller's is an empty slot)
  gpu::merge_forward({.shared = (Is > 0 && T > 0) ? y_s.p : nullptr, .slots = win_combine->ptr,
                      .weights = static_cast<const float*>(in.topk_w.data), .topk_idx = published(),
                      .abort = dc.claim, .tokens = T, .top_k = k, .hidden = H, .out = const_cast<void*>(out.data)},
                     stream);
  // The routing window is the next forward's: the backward of this one reads its own copy.
  if (slots.size() > 1 && T > 0)
    MOK_CUDA_CHECK(cudaMemcpyAsync(saved_routing.p, win_routing->ptr, static_cast<size_t>(T * k) * 4,
                                   cudaMemcpyDeviceToDevice, stream));
  saved = save_for_backward;
  return id;
}

Layer::Layer(comm::Communicator& comm, const LayerShape& shape, const Config& config,
             const DeviceWeights& weights)
    : impl_(std::make_unique<Impl>(comm, shape, config, weights)) {}

Layer::~Layer() = default;

int64_t Layer::forward(const RoutingRefs& in, const TensorRef& out, cudaStream_t stream, bool save_for_backward) {
  return impl_->forward(in, out, stream, save_for_backward);
}

void Layer::backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& grads, cudaStream_t stream,
                     int64_t forward_id) {
  impl_->backward(in, d_out, grads, stream, forward_id);
}

void Layer::set_weights(const DeviceWeights& weights) { impl_->set_weights(weights); }

void* Layer::input_buffer() const { return impl_->T > 0 ? impl_->win_x->ptr : nullptr; }

void Layer::check() {
  // Expired waits, here or on a peer (with a record naming the wait and the rank), and the
  // kernels' internal pipeline waits (abort word only); either poisons the communicator. Then
  // the routing problems the kernels found (the first one; the word is cleared).
  impl_->comm.check_waits();
  impl_->errors.check(impl_->k);
}

}  // namespace mok
