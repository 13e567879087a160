#include "mok/validate.hpp"

#include <cmath>

#include "mok/errors.hpp"

namespace mok {

namespace {
void check_rank(const LayerShape& shape, int rank) {
  MOK_REQUIRE(rank >= 0 && rank < shape.world_size(), "rank", "must be in [0, W) (W = ",
              shape.world_size(), "), got ", rank);
}
}  // namespace

void validate_routing_layout(const LayerShape& shape, int rank, const RoutingRefs& in) {
  shape.validate();
  check_rank(shape, rank);
  const int64_t T = shape.tokens_of(rank);
  check_tensor("x", in.x, {DType::BF16}, {T, shape.hidden});
  check_tensor("topk_idx", in.topk_idx, {DType::I32, DType::I64}, {T, shape.top_k});
  check_tensor("topk_w", in.topk_w, {DType::F32}, {T, shape.top_k});
}

void validate_weights_layout(const LayerShape& shape, const WeightRefs& w) {
  shape.validate();
  const int64_t el = shape.local_experts(), H = shape.hidden, I = shape.intermediate;
  check_tensor("w_gate", w.w_gate, {DType::BF16}, {el, I, H});
  check_tensor("w_up", w.w_up, {DType::BF16}, {el, I, H});
  check_tensor("w_down", w.w_down, {DType::BF16}, {el, H, I});
  if (shape.shared_intermediate > 0) {
    const int64_t Is = shape.shared_intermediate;
    check_tensor("ws_gate", w.ws_gate, {DType::BF16}, {Is, H});
    check_tensor("ws_up", w.ws_up, {DType::BF16}, {Is, H});
    check_tensor("ws_down", w.ws_down, {DType::BF16}, {H, Is});
  }
}

WeightRefs WeightRefs::bf16(const LayerShape& shape, const void* w_gate, const void* w_up, const void* w_down,
                            const void* ws_gate, const void* ws_up, const void* ws_down) {
  const int64_t el = shape.local_experts(), H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const auto t = [](const void* p, std::vector<int64_t> sizes) { return TensorRef::contiguous(p, DType::BF16, std::move(sizes)); };
  return {t(w_gate, {el, I, H}), t(w_up, {el, I, H}), t(w_down, {el, H, I}),
          t(ws_gate, {Is, H}),   t(ws_up, {Is, H}),   t(ws_down, {H, Is})};
}

GradRefs GradRefs::of(const LayerShape& shape, int rank, void* d_x, float* d_topk_w, void* d_w_gate, void* d_w_up,
                      void* d_w_down, void* d_ws_gate, void* d_ws_up, void* d_ws_down) {
  const int64_t T = shape.tokens_of(rank), k = shape.top_k;
  const WeightRefs w = WeightRefs::bf16(shape, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down);
  return {TensorRef::contiguous(d_x, DType::BF16, {T, shape.hidden}), TensorRef::contiguous(d_topk_w, DType::F32, {T, k}),
          w.w_gate, w.w_up, w.w_down, w.ws_gate, w.ws_up, w.ws_down};
}

void validate_grads_layout(const LayerShape& shape, int rank, const GradRefs& g) {
  shape.validate();
  check_rank(shape, rank);
  const int64_t T = shape.tokens_of(rank), k = shape.top_k, el = shape.local_experts(), H = shape.hidden,
                I = shape.intermediate;
  check_tensor("grads.d_x", g.d_x, {DType::BF16}, {T, H});
  check_tensor("grads.d_topk_w", g.d_topk_w, {DType::F32}, {T, k});
  // grads.accumulate: fp32 weight gradients added to (their dtype check names the flag's choice).
  const DType wd = g.accumulate ? DType::F32 : DType::BF16;
  check_tensor(g.accumulate ? "grads.d_w_gate (grads.accumulate)" : "grads.d_w_gate", g.d_w_gate, {wd}, {el, I, H});
  check_tensor(g.accumulate ? "grads.d_w_up (grads.accumulate)" : "grads.d_w_up", g.d_w_up, {wd}, {el, I, H});
  check_tensor(g.accumulate ? "grads.d_w_down (grads.accumulate)" : "grads.d_w_down", g.d_w_down, {wd}, {el, H, I});
  if (shape.shared_intermediate > 0) {
    const int64_t Is = shape.shared_intermediate;
    check_tensor("grads.d_ws_gate", g.d_ws_gate, {DType::BF16}, {Is, H});
    check_tensor("grads.d_ws_up", g.d_ws_up, {DType::BF16}, {Is, H});
    check_tensor("grads.d_ws_down", g.d_ws_down, {DType::BF16}, {H, Is});
  }
}

void validate_grad_output_layout(const LayerShape& shape, int rank, const TensorRef& d_out) {
  shape.validate();
  check_rank(shape, rank);
  check_tensor("d_out", d_out, {DType::BF16}, {shape.tokens_of(rank), shape.hidden});
}

void validate_routing_values(const LayerShape& shape, int rank, const RoutingRefs& in) {
  validate_routing_layout(shape, rank, in);
  const int64_t T = shape.tokens_of(rank), k = shape.top_k, E = shape.experts;
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t id = in.topk_idx.dtype == DType::I32
                           ? static_cast<const int32_t*>(in.topk_idx.data)[i]
                           : static_cast<const int64_t*>(in.topk_idx.data)[i];
    MOK_REQUIRE(id >= -1 && id < E, detail::concat("topk_idx[", i / k, ",", i % k, "]"),
                "expert ids must satisfy -1 <= id < E (E = ", E, "; -1 marks an empty slot), got ",
                id);
    const float w = static_cast<const float*>(in.topk_w.data)[i];
    MOK_REQUIRE(std::isfinite(w), detail::concat("topk_w[", i / k, ",", i % k, "]"),
                "router weights must be finite, got ", w);
    MOK_REQUIRE(w >= 0.0f, detail::concat("topk_w[", i / k, ",", i % k, "]"),
                "router weights must be >= 0, got ", w);
  }
}

}  // namespace mok
