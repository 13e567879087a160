// mok._cpu — the CPU reference engine (the executable spec, src/reference) for one rank, on host
// arrays handed over by DLPack (PyTorch CPU tensors, NumPy arrays): forward and backward of the
// layer with every expert on this rank. Used by mok.moe for CPU tensors, so a model built on
// mok.MoE can be unit-tested without a GPU, and as the golden model in the Python tests.
//
// Why nanobind and raw host arrays rather than torch's C++ extension API: the module links
// nothing of libtorch, so one build works with every PyTorch version (no C++ ABI coupling), builds
// in seconds, and imports without PyTorch or a GPU. Tensors arrive as DLPack views (no copy on the
// way in); outputs are written into arrays the caller allocated.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mok/errors.hpp"
#include "mok/memory.hpp"
#include "mok/reference.hpp"
#include "mok/validate.hpp"
#include "knobs.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

mok::DType dtype_of(const Array& a, const char* name) {
  const nb::dlpack::dtype d = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(d.code);
  if (d.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Bfloat && d.bits == 16) return mok::DType::BF16;
    if (code == nb::dlpack::dtype_code::Float && d.bits == 32) return mok::DType::F32;
    if (code == nb::dlpack::dtype_code::Int && d.bits == 32) return mok::DType::I32;
    if (code == nb::dlpack::dtype_code::Int && d.bits == 64) return mok::DType::I64;
  }
  throw mok::Error(mok::ErrorKind::InvalidArgument, name, "dtype must be bfloat16, float32, int32 or int64");
}

mok::TensorRef ref_of(const Array& a, const char* name) {
  mok::TensorRef t;
  t.data = a.data();
  t.dtype = dtype_of(a, name);
  for (size_t i = 0; i < a.ndim(); ++i) t.sizes.push_back(static_cast<int64_t>(a.shape(i)));
  return t;
}

template <typename T>
std::vector<T> copy_of(const mok::TensorRef& t) {
  const auto* p = static_cast<const T*>(t.data);
  return std::vector<T>(p, p + t.numel());
}

template <typename T>
void write(const std::vector<T>& v, const Array& out, const char* name, mok::DType dtype) {
  const mok::TensorRef r = ref_of(out, name);
  MOK_REQUIRE(r.dtype == dtype && r.numel() == static_cast<int64_t>(v.size()), name, "must be a ", to_string(dtype),
              " array of ", v.size(), " elements, got ", to_string(r.dtype), " with ", r.numel());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * sizeof(T));
}

// One rank's layer as the arrays describe it: T, H from x; k from topk_idx; E, I from w_gate;
// Is from ws_gate (0 without a shared expert). Every array is checked like the C++ API's.
struct Problem {
  mok::LayerShape shape;
  std::vector<mok::ref::RankInput> in{1};
  mok::ref::LayerWeights w;
  mok::Config config;
};

Problem problem(const Array& x, const Array& topk_idx, const Array& topk_w, const Array& w_gate, const Array& w_up,
                const Array& w_down, const std::optional<Array>& ws_gate, const std::optional<Array>& ws_up,
                const std::optional<Array>& ws_down, int threads) {
  const mok::TensorRef xr = ref_of(x, "x"), ir = ref_of(topk_idx, "topk_idx"), wr = ref_of(topk_w, "topk_w");
  const mok::TensorRef g = ref_of(w_gate, "w_gate");
  MOK_REQUIRE(xr.sizes.size() == 2, "x", "must be [T, H], got ", xr.sizes.size(), " dimensions");
  MOK_REQUIRE(ir.sizes.size() == 2, "topk_idx", "must be [T, k], got ", ir.sizes.size(), " dimensions");
  MOK_REQUIRE(g.sizes.size() == 3, "w_gate", "must be [E, I, H], got ", g.sizes.size(), " dimensions");
  const bool shared = ws_gate.has_value();
  MOK_REQUIRE(shared == ws_up.has_value() && shared == ws_down.has_value(), "ws_gate/ws_up/ws_down",
              "the shared expert needs all three weights or none");
  Problem p;
  const int64_t Is = shared ? static_cast<int64_t>(ws_gate->shape(0)) : 0;
  p.shape = mok::LayerShape{{xr.sizes[0]}, xr.sizes[1], g.sizes[1], g.sizes[0], ir.sizes[1], Is};
  p.config.cpu_threads = threads;
  const mok::RoutingRefs refs{xr, ir, wr};
  mok::validate_routing_values(p.shape, 0, refs);  // shapes, dtypes, ids in [-1, E), finite weights >= 0
  mok::WeightRefs wrefs{g, ref_of(w_up, "w_up"), ref_of(w_down, "w_down"), {}, {}, {}};
  if (shared) {
    wrefs.ws_gate = ref_of(*ws_gate, "ws_gate");
    wrefs.ws_up = ref_of(*ws_up, "ws_up");
    wrefs.ws_down = ref_of(*ws_down, "ws_down");
  }
  mok::validate_weights_layout(p.shape, wrefs);
  mok::ref::RankInput& r = p.in[0];
  r.x = copy_of<mok::bf16>(xr);
  if (ir.dtype == mok::DType::I32) {
    r.topk_idx = copy_of<int32_t>(ir);
  } else {  // checked above: every id fits in int32
    for (const int64_t v : copy_of<int64_t>(ir)) r.topk_idx.push_back(static_cast<int32_t>(v));
  }
  r.topk_w = copy_of<float>(wr);
  p.w.w_gate = copy_of<mok::bf16>(wrefs.w_gate);
  p.w.w_up = copy_of<mok::bf16>(wrefs.w_up);
  p.w.w_down = copy_of<mok::bf16>(wrefs.w_down);
  if (shared) {
    p.w.ws_gate = copy_of<mok::bf16>(wrefs.ws_gate);
    p.w.ws_up = copy_of<mok::bf16>(wrefs.ws_up);
    p.w.ws_down = copy_of<mok::bf16>(wrefs.ws_down);
  }
  return p;
}

void forward(const Array& x, const Array& topk_idx, const Array& topk_w, const Array& w_gate, const Array& w_up,
             const Array& w_down, const std::optional<Array>& ws_gate, const std::optional<Array>& ws_up,
             const std::optional<Array>& ws_down, const Array& out, int threads, const std::string& precision) {
  Problem p = problem(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, threads);
  p.config.precision = mok::python::precision_named(precision);  // the engine's FP8 recipes
  mok::ref::ForwardResult res;
  {
    nb::gil_scoped_release release;  // the engine runs its own threads
    res = mok::ref::Engine(p.shape, p.config).forward(p.in, p.w);
  }
  write(res.out[0], out, "out", mok::DType::BF16);
}

// grads: d_x, d_topk_w, d_w_gate, d_w_up, d_w_down[, d_ws_gate, d_ws_up, d_ws_down].
void backward(const Array& x, const Array& topk_idx, const Array& topk_w, const Array& w_gate, const Array& w_up,
              const Array& w_down, const std::optional<Array>& ws_gate, const std::optional<Array>& ws_up,
              const std::optional<Array>& ws_down, const Array& d_out, const std::vector<Array>& grads,
              int threads, const std::string& precision) {
  Problem p = problem(x, topk_idx, topk_w, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, threads);
  // The engine's FP8 backward (recipe 1); MXFP8's is refused there by name.
  p.config.precision = mok::python::precision_named(precision);
  const mok::TensorRef dr = ref_of(d_out, "d_out");
  mok::validate_grad_output_layout(p.shape, 0, dr);
  const size_t want = p.shape.shared_intermediate > 0 ? 8 : 5;
  MOK_REQUIRE(grads.size() == want, "grads", "needs ", want, " arrays, got ", grads.size());
  const std::vector<std::vector<mok::bf16>> d{copy_of<mok::bf16>(dr)};
  mok::ref::Gradients gr;
  {
    nb::gil_scoped_release release;
    gr = mok::ref::Engine(p.shape, p.config).backward(p.in, p.w, d);
  }
  write(gr.d_x[0], grads[0], "d_x", mok::DType::BF16);
  write(gr.d_topk_w[0], grads[1], "d_topk_w", mok::DType::F32);
  write(gr.d_w_gate, grads[2], "d_w_gate", mok::DType::BF16);
  write(gr.d_w_up, grads[3], "d_w_up", mok::DType::BF16);
  write(gr.d_w_down, grads[4], "d_w_down", mok::DType::BF16);
  if (want == 8) {
    write(gr.d_ws_gate[0], grads[5], "d_ws_gate", mok::DType::BF16);
    write(gr.d_ws_up[0], grads[6], "d_ws_up", mok::DType::BF16);
    write(gr.d_ws_down[0], grads[7], "d_ws_down", mok::DType::BF16);
  }
}

// The GPU layer's planned device memory (include/mok/memory.hpp) for one rank of an EP group of
// `world` ranks with `tokens` each, the Config of mok.MoE's knobs (by name, as text): a list of
// (name, bytes, scope, symmetric, workspace).
std::vector<std::tuple<std::string, int64_t, std::string, bool, bool>> plan_memory(
    int64_t tokens, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, int64_t shared, int world,
    const std::map<std::string, std::string>& knobs, int sm_count) {
  mok::Config cfg;
  mok::python::apply_knobs(cfg, knobs);
  const auto shape = mok::LayerShape::uniform(world, tokens, hidden, inter, experts, top_k, shared);
  std::vector<std::tuple<std::string, int64_t, std::string, bool, bool>> out;
  for (const mok::BufferBytes& b : mok::plan_memory(shape, cfg, 0, sm_count).buffers)
    out.emplace_back(b.name, b.bytes, mok::to_string(b.scope), b.symmetric, b.workspace);
  return out;
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "mok's CPU reference engine (one rank): the layer's specification, on host arrays";
  // mok::Error -> mok.Error (a ValueError): the message names the argument and the constraint.
  static nb::exception<mok::Error> error(m, "Error", PyExc_ValueError);
  m.def("forward", &forward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_w"), nb::arg("w_gate"),
        nb::arg("w_up"), nb::arg("w_down"), nb::arg("ws_gate").none(), nb::arg("ws_up").none(),
        nb::arg("ws_down").none(), nb::arg("out"), nb::arg("threads") = 0, nb::arg("precision") = "bf16",
        "out = the layer applied to one rank's tokens (all experts on this rank); precision: bf16, or the "
        "FP8 recipes fp8 / mxfp8 (x, the weights and h as their codes decode).");
  m.def("backward", &backward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_w"), nb::arg("w_gate"),
        nb::arg("w_up"), nb::arg("w_down"), nb::arg("ws_gate").none(), nb::arg("ws_up").none(),
        nb::arg("ws_down").none(), nb::arg("d_out"), nb::arg("grads"), nb::arg("threads") = 0,
        nb::arg("precision") = "bf16",
        "Writes d_x, d_topk_w, d_w_gate, d_w_up, d_w_down (and the shared expert's) into `grads`; "
        "precision: bf16, fp8 (recipe 1's backward) or mxfp8 (recipe 2's).");
  // mok::Config's bound of device waits when the wait_timeout_s knob is not given (mok.MoE keys its
  // shared communicators by it).
  m.attr("DEFAULT_WAIT_TIMEOUT_S") = mok::Config{}.wait_timeout_s;
  m.def("plan_memory", &plan_memory, nb::arg("tokens"), nb::arg("hidden"), nb::arg("intermediate"),
        nb::arg("experts"), nb::arg("top_k"), nb::arg("shared_intermediate") = 0, nb::arg("world") = 1,
        nb::arg("config") = std::map<std::string, std::string>{}, nb::arg("sm_count") = 132,
        "The GPU layer's planned device memory on one rank: [(name, bytes, scope, symmetric, workspace)].");
}
