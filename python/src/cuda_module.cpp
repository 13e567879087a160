// mok._cuda — the GPU layer (mok::Layer: the forward megakernel and the backward) for PyTorch
// CUDA tensors, one rank per process. Tensors arrive as raw device addresses with their shapes
// known from the layer, and run on the caller's stream (PyTorch's current stream). Like mok._cpu it
// links nothing of libtorch; it links the NCCL mok was compiled against, which must be the NCCL the
// process loads (PyTorch's): mok checks the version when the communicator is created and names a
// mismatch.
//
// A Communicator is one rank of an EP group (mok::comm::Communicator): made from an NCCL unique id
// that the Python side sends to every rank over the torch ProcessGroup (mok owns that NCCL
// communicator, non-blocking, so every host wait on it is bounded), or wrapping the group's own
// NCCL communicator. Every Layer on one Communicator shares its workspace (Config::share_workspace):
// mok.MoE modules on one group and device share one Communicator (python/mok/_comm.py), so that a
// model's layers hold one workspace per GPU, not one each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nccl.h>

#include "mok/comm.hpp"
#include "mok/errors.hpp"
#include "mok/layer.hpp"
#include "knobs.h"

namespace nb = nanobind;

namespace {

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// Destroys `p` without the GIL (a layer's teardown synchronizes its device, a communicator's may
// wait for its peers), except while the interpreter finalizes (no thread may take it back then).
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

template <typename T>
void release_gil_and_reset(std::unique_ptr<T>& p) {
  if (!p) return;
  if (interpreter_finalizing()) {
    p.reset();
    return;
  }
  nb::gil_scoped_release release;
  p.reset();
}

mok::comm::CommOptions comm_options(double wait_timeout_s, double bootstrap_timeout_s) {
  mok::comm::CommOptions opt;  // no shape: the layers on it have theirs (compared when each is built)
  opt.config.wait_timeout_s = wait_timeout_s;
  opt.bootstrap_timeout_s = bootstrap_timeout_s;
  return opt;
}

// One rank of an EP group: the communicator every Layer of this rank on the group's device uses.
class GpuComm {
 public:
  // Rank `rank` of `world` on GPU `device`, all ranks passing the same NCCL unique id (unique_id()).
  GpuComm(int device, int rank, int world, const nb::bytes& id, double wait_timeout_s, double bootstrap_timeout_s) {
    ncclUniqueId uid;
    MOK_REQUIRE(id.size() == sizeof(uid), "unique_id", "must be the ", sizeof(uid),
                " bytes of an NCCL unique id (mok._cuda.unique_id()), got ", id.size());
    std::memcpy(&uid, id.c_str(), sizeof(uid));
    const auto opt = comm_options(wait_timeout_s, bootstrap_timeout_s);
    nb::gil_scoped_release release;  // collective: the other ranks' threads may need the GIL meanwhile
    comm_ = mok::comm::Communicator::from_unique_id(uid, rank, world, device, opt);
  }
  // Wraps an existing ncclComm_t (a torch ProcessGroupNCCL's), which mok does not own: it must
  // outlive this object (and every Layer on it).
  GpuComm(uintptr_t nccl_comm, double wait_timeout_s, double bootstrap_timeout_s) {
    MOK_REQUIRE(nccl_comm != 0, "nccl_comm", "must be an initialized ncclComm_t, got null (run a collective on the "
                "group first: torch creates its NCCL communicator lazily)");
    const auto opt = comm_options(wait_timeout_s, bootstrap_timeout_s);
    nb::gil_scoped_release release;
    comm_ = mok::comm::Communicator::from_nccl_comm(reinterpret_cast<ncclComm_t>(nccl_comm), opt);
  }
  // Teardown may wait for the peers (bounded): without the GIL, which their threads may need.
  ~GpuComm() { release_gil_and_reset(comm_); }
  mok::comm::Communicator& get() { return *comm_; }
  bool poisoned() const { return comm_->poisoned(); }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->world_size(); }
  int device() const { return comm_->device(); }
  bool owns_nccl_comm() const { return comm_->owns_nccl_comm(); }

 private:
  std::unique_ptr<mok::comm::Communicator> comm_;
};

class GpuLayer {
 public:
  // One rank's layer on `comm` (collective over its ranks: every rank builds it with the same
  // shape and config, in the same order). tokens: this rank's T, which every rank must share (a
  // mismatch is named by the layer's handshake). Weight addresses: w_gate, w_up, w_down[, ws_gate,
  // ws_up, ws_down] (bf16, contiguous; the routed ones this rank's experts).
  GpuLayer(GpuComm& comm, int64_t tokens, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
           int64_t shared_inter, const std::vector<uintptr_t>& weights,
           const std::map<std::string, std::string>& knobs)
      : shape_(mok::LayerShape::uniform(comm.world_size(), tokens, hidden, inter, experts, top_k, shared_inter)),
        rank_(comm.rank()) {
    MOK_REQUIRE(weights.size() == (shared_inter > 0 ? 6u : 3u), "weights", "needs ", shared_inter > 0 ? 6 : 3,
                " addresses, got ", weights.size());
    mok::python::apply_knobs(config_, knobs);
    const auto w = [&](size_t i) { return i < weights.size() ? ptr(weights[i]) : nullptr; };
    const mok::DeviceWeights dw = mok::DeviceWeights::bf16(shape_, w(0), w(1), w(2), w(3), w(4), w(5));
    nb::gil_scoped_release release;  // collective (window registration, the handshake)
    layer_ = std::make_unique<mok::Layer>(comm.get(), shape_, config_, dw);
  }
  ~GpuLayer() { release_gil_and_reset(layer_); }

  // Returns the forward's number (mok::Layer::forward), which backward() takes.
  int64_t forward(uintptr_t x, uintptr_t idx, bool idx_int64, uintptr_t w, uintptr_t out, uintptr_t stream,
                  bool save) {
    nb::gil_scoped_release release;
    return layer_->forward(refs(x, idx, idx_int64, w), tensor(out, mok::DType::BF16, {T(), shape_.hidden}),
                           reinterpret_cast<cudaStream_t>(stream), save);
  }

  // grads: d_x, d_topk_w, d_w_gate, d_w_up, d_w_down[, d_ws_gate, d_ws_up, d_ws_down]. accumulate
  // (mok::GradRefs::accumulate): d_w_gate, d_w_up, d_w_down are fp32 and the gradients are added to them.
  void backward(uintptr_t x, uintptr_t idx, bool idx_int64, uintptr_t w, uintptr_t d_out,
                const std::vector<uintptr_t>& grads, uintptr_t stream, int64_t forward_id, bool accumulate) {
    MOK_REQUIRE(grads.size() == (shape_.shared_intermediate > 0 ? 8u : 5u), "grads", "wrong number of addresses (",
                grads.size(), ")");
    nb::gil_scoped_release release;
    const auto g = [&](size_t i) { return i < grads.size() ? ptr(grads[i]) : nullptr; };
    mok::DeviceGrads dg = mok::DeviceGrads::of(shape_, rank_, g(0), static_cast<float*>(g(1)), g(2), g(3), g(4), g(5),
                                               g(6), g(7));
    if (accumulate) {
      const int64_t el = shape_.local_experts(), H = shape_.hidden, I = shape_.intermediate;
      dg.accumulate = true;
      dg.d_w_gate = tensor(grads[2], mok::DType::F32, {el, I, H});
      dg.d_w_up = tensor(grads[3], mok::DType::F32, {el, I, H});
      dg.d_w_down = tensor(grads[4], mok::DType::F32, {el, H, I});
    }
    layer_->backward(refs(x, idx, idx_int64, w), tensor(d_out, mok::DType::BF16, {T(), shape_.hidden}), dg,
                     reinterpret_cast<cudaStream_t>(stream), forward_id);
  }

  // The layer reads the weights where they are (in-place updates need nothing); other tensors
  // (e.g. after .to() or load_state_dict(assign=True)) are handed over here.
  void set_weights(const std::vector<uintptr_t>& weights) {
    const auto w = [&](size_t i) { return i < weights.size() ? ptr(weights[i]) : nullptr; };
    layer_->set_weights(mok::DeviceWeights::bf16(shape_, w(0), w(1), w(2), w(3), w(4), w(5)));
  }
  void check() { layer_->check(); }

 private:
  int64_t T() const { return shape_.tokens_of(rank_); }
  static mok::TensorRef tensor(uintptr_t p, mok::DType t, std::vector<int64_t> sizes) {
    return mok::TensorRef::contiguous(ptr(p), t, std::move(sizes));
  }
  mok::RoutingRefs refs(uintptr_t x, uintptr_t idx, bool idx_int64, uintptr_t w) const {
    return {tensor(x, mok::DType::BF16, {T(), shape_.hidden}),
            tensor(idx, idx_int64 ? mok::DType::I64 : mok::DType::I32, {T(), shape_.top_k}),
            tensor(w, mok::DType::F32, {T(), shape_.top_k})};
  }
  mok::LayerShape shape_;
  int rank_ = 0;
  mok::Config config_;
  std::unique_ptr<mok::Layer> layer_;  // its Communicator outlives it (nb::keep_alive in the binding)
};

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "mok's GPU layer (one rank of an EP group per process) on raw CUDA addresses";
  // mok::Error -> mok.Error, the one exception type of the package (defined by mok._cpu).
  static PyObject* error_type = nb::object(nb::module_::import_("mok._cpu").attr("Error")).release().ptr();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mok::Error& e) {
      PyErr_SetString(error_type, e.what());
    }
  });
  // The NCCL mok's device code was compiled against and the one this process has loaded (the
  // first libnccl.so.2 loaded wins: PyTorch's, when torch was imported first). mok.MoE compares
  // them before building a layer and names a mismatch.
  m.def("nccl_versions", [] {
    int runtime = 0;
    (void)ncclGetVersion(&runtime);
    return std::make_pair(int(NCCL_VERSION_CODE), runtime);
  });
  m.def("unique_id", [] {
    ncclUniqueId id;
    const ncclResult_t r = ncclGetUniqueId(&id);
    MOK_REQUIRE(r == ncclSuccess, "ncclGetUniqueId", "failed: ", ncclGetErrorString(r));
    return nb::bytes(id.internal, sizeof(id.internal));
  }, "A new NCCL unique id (bytes) for Communicator: made on one rank, sent to the others");
  nb::class_<GpuComm>(m, "Communicator", nb::is_weak_referenceable())
      .def(nb::init<int, int, int, const nb::bytes&, double, double>(), nb::arg("device"), nb::arg("rank"),
           nb::arg("world_size"), nb::arg("unique_id"), nb::arg("wait_timeout_s") = mok::Config{}.wait_timeout_s,
           nb::arg("bootstrap_timeout_s") = 300.0,
           "Collective: rank `rank` of `world_size` on GPU `device`; every rank passes the same unique_id")
      .def_static("adopt", [](uintptr_t nccl_comm, double wait_timeout_s, double bootstrap_timeout_s) {
            return new GpuComm(nccl_comm, wait_timeout_s, bootstrap_timeout_s);
          }, nb::arg("nccl_comm"), nb::arg("wait_timeout_s") = mok::Config{}.wait_timeout_s, nb::arg("bootstrap_timeout_s") = 300.0,
          nb::rv_policy::take_ownership,
          "Collective: wraps an initialized ncclComm_t (a torch ProcessGroupNCCL's _comm_ptr()), not owned")
      .def_prop_ro("rank", &GpuComm::rank)
      .def_prop_ro("world_size", &GpuComm::world_size)
      .def_prop_ro("device", &GpuComm::device)
      .def_prop_ro("owns_nccl_comm", &GpuComm::owns_nccl_comm)
      .def_prop_ro("poisoned", &GpuComm::poisoned);
  nb::class_<GpuLayer>(m, "Layer")
      .def(nb::init<GpuComm&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const std::vector<uintptr_t>&,
                    const std::map<std::string, std::string>&>(),
           nb::arg("comm"), nb::arg("tokens"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("experts"),
           nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("weights"),
           nb::arg("config") = std::map<std::string, std::string>{},
           nb::keep_alive<1, 2>(),  // the layer keeps its communicator alive
           "Collective over comm's ranks. config: mok::Config knobs by name, values as text (mok.MoE passes its "
           "keyword arguments)")
      .def("forward", &GpuLayer::forward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("idx_int64"),
           nb::arg("topk_w"), nb::arg("out"), nb::arg("stream"), nb::arg("save_for_backward") = true)
      .def("backward", &GpuLayer::backward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("idx_int64"),
           nb::arg("topk_w"), nb::arg("d_out"), nb::arg("grads"), nb::arg("stream"), nb::arg("forward_id") = -1,
           nb::arg("accumulate") = false)
      .def("set_weights", &GpuLayer::set_weights, nb::arg("weights"))
      .def("check", &GpuLayer::check);
}
