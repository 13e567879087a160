// The unfused forward path of one rank (see include/mok/layer.hpp for the sequence and its
// synchronization argument).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "comm/device.cuh"
#include "common/cuda_check.h"
#include "common/device_error.h"
#include "gemm/grouped_gemm.h"
#include "megakernel/dispatch.h"
#include "megakernel/merge.h"
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

}  // namespace

struct Layer::Impl {
  comm::Communicator& comm;
  LayerShape shape;
  Config config;
  DeviceWeights weights;
  int rank = 0, world = 1;
  int64_t H = 0, I = 0, k = 0, e_loc = 0, Is = 0, T = 0, cap_rows = 0, t_tiles = 0;
  const comm::Window* win_routing = nullptr;
  const comm::Window* win_x = nullptr;
  const comm::Window* win_combine = nullptr;
  comm::dev::DeviceComm dc{};
  DeviceErrorWord errors;
  DeviceBuffer tables, x_peers, combine_peers;
  std::unique_ptr<gpu::ScheduleBuilder> schedule;
  DeviceBuffer w1p, x_routed, gu, h, y;
  DeviceBuffer ws1p, shared_tiles, gu_s, h_s, y_s;
  gemm::Plan fc1, fc2, fc1_s, fc2_s;

  Impl(comm::Communicator& c, const LayerShape& s, const Config& cfg, const DeviceWeights& w)
      : comm(c), shape(s), config(cfg), weights(w) {
    int sms = 0;
    MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()));
    config.validate(shape, sms);
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

    // Symmetric windows, equal on every rank (sized by the largest T). Names carry the number of
    // windows already registered so several layers can share one communicator.
    const int64_t t_max = shape.max_tokens(), t_max_pad = sched::pad_rows(t_max);
    const std::string tag = "mok.layer" + std::to_string(comm.window_count());
    win_routing = &comm.add_window(tag + ".routing", static_cast<size_t>(std::max<int64_t>(1, t_max * k)) * 4);
    win_x = &comm.add_window(tag + ".x", static_cast<size_t>(std::max<int64_t>(1, t_max_pad * H)) * 2);
    win_combine = &comm.add_window(tag + ".combine", static_cast<size_t>(std::max<int64_t>(1, t_max * k * H)) * 2);
    dc = comm::dev::make_device_comm(comm);
    std::vector<const void*> tab(world), xp(world);
    std::vector<void*> cp(world);
    for (int r = 0; r < world; ++r) {
      tab[r] = comm::dev::lsa_pointer(comm, *win_routing, r);
      xp[r] = comm::dev::lsa_pointer(comm, *win_x, r);
      cp[r] = comm::dev::lsa_pointer(comm, *win_combine, r);
    }
    tables = upload_array(tab, "schedule tables");
    x_peers = upload_array(xp, "x peers");
    combine_peers = upload_array(cp, "combine peers");
    schedule = std::make_unique<gpu::ScheduleBuilder>(shape, config, rank, tables.get<const int32_t* const>());

    // Routed buffers for the worst case (one macrobatch: the ring is the megakernel's).
    cap_rows = shape.worst_case_rows();
    w1p = DeviceBuffer(static_cast<size_t>(e_loc * 2 * I * H) * 2, "w1p");
    x_routed = DeviceBuffer(static_cast<size_t>(cap_rows * H) * 2, "x_routed");
    gu = DeviceBuffer(static_cast<size_t>(cap_rows * 2 * I) * 2, "gu");
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
    fc1 = gemm::plan_fc1(a1);
    gemm::Fc2Args a2;
    a2.a = h.p;
    a2.w = weights.w_down;
    a2.y = y.p;
    a2.k = I;
    a2.n = H;
    a2.experts = e_loc;
    a2.tile_expert = v.tile_expert;
    a2.num_m_tiles = cap_rows / sched::kBlockM;
    fc2 = gemm::plan_fc2(a2);

    // Shared expert: one "expert" over this rank's tokens, read straight from the x window.
    t_tiles = sched::ceil_div(T, sched::kBlockM);
    if (Is > 0 && T > 0) {
      ws1p = DeviceBuffer(static_cast<size_t>(2 * Is * H) * 2, "ws1p");
      shared_tiles = upload_array(std::vector<int32_t>(static_cast<size_t>(t_tiles), 0), "shared tiles");
      gu_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * 2 * Is) * 2, "gu_s");
      h_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * Is) * 2, "h_s");
      y_s = DeviceBuffer(static_cast<size_t>(t_tiles * 128 * H) * 2, "y_s");
      gemm::Fc1Args s1 = a1;
      s1.x = win_x->ptr;
      s1.w1p = ws1p.p;
      s1.h = h_s.p;
      s1.gu = gu_s.p;
      s1.inter = Is;
      s1.experts = 1;
      s1.tile_expert = shared_tiles.get<const int32_t>();
      s1.num_m_tiles = t_tiles;
      fc1_s = gemm::plan_fc1(s1);
      gemm::Fc2Args s2 = a2;
      s2.a = h_s.p;
      s2.w = weights.ws_down;
      s2.y = y_s.p;
      s2.k = Is;
      s2.experts = 1;
      s2.tile_expert = shared_tiles.get<const int32_t>();
      s2.num_m_tiles = t_tiles;
      fc2_s = gemm::plan_fc2(s2);
    }
    repack(nullptr);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
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
    a.sms = config.fwd_comm_sms;
    return a;
  }

  void forward(const RoutingRefs& in, void* out, cudaStream_t stream) {
    validate_routing_layout(shape, rank, in);
    MOK_REQUIRE(out != nullptr || T == 0, "out", "must be a [T, H] bf16 device buffer");
    if (T > 0)
      MOK_CUDA_CHECK(cudaMemcpyAsync(win_x->ptr, in.x.data, static_cast<size_t>(T * H) * 2,
                                     cudaMemcpyDeviceToDevice, stream));
    gpu::publish_routing(in.topk_idx.data, in.topk_idx.dtype == DType::I64, T, k, shape.experts,
                         rank, static_cast<int32_t*>(win_routing->ptr), errors.device(), stream);
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // routing and x visible to every rank
    MOK_CUDA_CHECK(cudaGetLastError());
    schedule->build(stream);
    gpu::pull_dispatch(move_args(), x_peers.get<const void* const>(), x_routed.p, stream);
    gemm::run(fc1, stream);
    gemm::run(fc2, stream);
    gpu::push_combine(move_args(), y.p, combine_peers.get<void* const>(), stream);
    barrier_kernel<<<1, 64, 0, stream>>>(dc, 0);  // every push into our combine slots landed
    MOK_CUDA_CHECK(cudaGetLastError());
    if (Is > 0 && T > 0) {
      gemm::run(fc1_s, stream);
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
};

Layer::Layer(comm::Communicator& comm, const LayerShape& shape, const Config& config,
             const DeviceWeights& weights)
    : impl_(std::make_unique<Impl>(comm, shape, config, weights)) {}

Layer::~Layer() = default;

void Layer::forward(const RoutingRefs& in, void* out, cudaStream_t stream) { impl_->forward(in, out, stream); }

void Layer::repack(cudaStream_t stream) { impl_->repack(stream); }

void Layer::check() {
  impl_->comm.check_waits();
  impl_->errors.check(impl_->k);
}

}  // namespace mok
