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
