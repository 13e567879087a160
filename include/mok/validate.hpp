// mok — validation of every tensor the layer takes.
//
// Shape/dtype/layout checks work on any TensorRef. Value checks (expert ids in range, router
// weights finite and non-negative) need host-readable data; on the GPU path the schedule kernel
// performs the id check itself and reports through the error word.
#pragma once

#include <cstdint>

#include "mok/config.hpp"
#include "mok/tensor.hpp"

namespace mok {

// One rank's activations and routing.
struct RoutingRefs {
  TensorRef x;         // [T, H] bf16
  TensorRef topk_idx;  // [T, k] int32 or int64, global expert ids, -1 = empty slot
  TensorRef topk_w;    // [T, k] f32, finite and >= 0
};

// One rank's weights: its E_loc routed experts and the (replicated) shared expert.
struct WeightRefs {
  TensorRef w_gate;   // [E_loc, I, H] bf16
  TensorRef w_up;     // [E_loc, I, H] bf16
  TensorRef w_down;   // [E_loc, H, I] bf16
  TensorRef ws_gate;  // [Is, H] bf16 (ignored when Is = 0)
  TensorRef ws_up;    // [Is, H] bf16
  TensorRef ws_down;  // [H, Is] bf16

  // Contiguous bf16 tensors of the shapes above at these addresses (the shared expert's may be
  // null when Is = 0).
  static WeightRefs bf16(const LayerShape& shape, const void* w_gate, const void* w_up, const void* w_down,
                         const void* ws_gate = nullptr, const void* ws_up = nullptr, const void* ws_down = nullptr);
};

// One rank's gradients (outputs of the backward, overwritten): the same shapes as the inputs and
// weights they belong to. With `accumulate`, the routed experts' weight gradients are fp32 and the
// backward adds to them (gradient accumulation into a `main_grad`, as training stacks keep one per
// weight): d_w += the gradient's fp32 sums, never rounded to bf16, each element added once in a
// fixed order (deterministic). The bf16 unfused backward only (not config.backward_path fused,
// not FP8 / MXFP8: refused by name).
struct GradRefs {
  TensorRef d_x;        // [T, H] bf16
  TensorRef d_topk_w;   // [T, k] f32; 0 for empty slots
  TensorRef d_w_gate;   // [E_loc, I, H] bf16 (f32 with accumulate)
  TensorRef d_w_up;     // [E_loc, I, H] bf16 (f32 with accumulate)
  TensorRef d_w_down;   // [E_loc, H, I] bf16 (f32 with accumulate)
  TensorRef d_ws_gate;  // [Is, H] bf16 (ignored when Is = 0)
  TensorRef d_ws_up;    // [Is, H] bf16
  TensorRef d_ws_down;  // [H, Is] bf16
  bool accumulate = false;

  // Contiguous tensors of the shapes above for rank `rank` at these addresses.
  static GradRefs of(const LayerShape& shape, int rank, void* d_x, float* d_topk_w, void* d_w_gate, void* d_w_up,
                     void* d_w_down, void* d_ws_gate = nullptr, void* d_ws_up = nullptr, void* d_ws_down = nullptr);
};

// Shapes, dtypes and layouts of one rank's forward inputs.
void validate_routing_layout(const LayerShape& shape, int rank, const RoutingRefs& in);
void validate_weights_layout(const LayerShape& shape, const WeightRefs& w);
// d_out of the backward pass: [T, H] bf16.
void validate_grad_output_layout(const LayerShape& shape, int rank, const TensorRef& d_out);
// The backward's outputs (the shared expert's only when Is > 0).
void validate_grads_layout(const LayerShape& shape, int rank, const GradRefs& g);

// Values of host-resident routing tensors: every id in [-1, E), every weight finite and >= 0.
// The error names the first offending element, e.g. "topk_idx[5,2]".
void validate_routing_values(const LayerShape& shape, int rank, const RoutingRefs& in);

}  // namespace mok
