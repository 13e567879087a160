// mok — one rank's expert-parallel MoE layer on the GPU.
//
// Construct one Layer per rank (collectively: window registration is collective over the
// communicator) with this rank's weights; call forward() each step. forward() only enqueues
// work on the given stream: no host synchronization, no allocation. Device-side problems
// (invalid expert ids, an expired wait) are raised by check().
//
// Forward: publish routing, LSA barrier, GPU schedule, then (Config::forward_path) either the
// persistent megakernel (src/megakernel/forward_kernel.cu: pull dispatch, FC1 + SwiGLU, FC2, push
// combine and the shared expert in one kernel) or the unfused sequence of kernels kept as
// baseline and fallback; then an LSA barrier and the merge.
// Backward (unfused kernels for now; a backward megakernel will mirror the forward): d_out and the
// router weights published, the router-weight gradient from the combine slots, LSA barrier,
// reverse-combine pull (weighted), FC2 dgrad + SwiGLU backward, FC1 dgrad, reverse-dispatch push,
// the weight gradients, LSA barrier, the shared expert's backward and the d_x merge.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "mok/comm.hpp"
#include "mok/config.hpp"
#include "mok/validate.hpp"

namespace mok {

// This rank's weights in device memory (bf16, contiguous): the E_loc routed experts and the
// shared expert (ignored when Is = 0); shapes in validate.hpp's WeightRefs
// (WeightRefs::bf16(shape, w_gate, w_up, w_down, ...) builds them from pointers).
using DeviceWeights = WeightRefs;
// Outputs of backward(): device tensors of this rank, overwritten; shapes in validate.hpp's GradRefs
// (GradRefs::of(shape, rank, ...) builds them from pointers). Every one is required (the shared
// expert's only when Is > 0). GradRefs::accumulate: the routed experts' weight gradients are fp32
// tensors the backward adds to (gradient accumulation into a main_grad; bf16 unfused backward). The shared expert's gradients are over this
// rank's tokens only (a data-parallel partial: sum them over the ranks as for any replicated
// weight).
using DeviceGrads = GradRefs;

class Layer {
 public:
  // Collective over `comm`'s ranks; `comm` must outlive the layer. Validates shape/config against
  // the device (comm SMs < SM count) and the weights (as every tensor above), compares shape and
  // config across the ranks (the first field that differs is named, on every rank), allocates
  // every buffer for the worst case and registers the symmetric windows. The weights are read
  // where they are, by every call (no copy): updating them in place (an optimizer step) between
  // calls needs nothing more; set_weights() points the layer at other tensors.
  // config.precision FP8 / MXFP8 is the exception: the layer holds the weights' E4M3 codes and scales,
  // made here and by every set_weights() — after an in-place update call set_weights() again
  // (the same pointers will do); it waits for the device, and calls enqueued or captured before
  // it read the new codes when they run.
  Layer(comm::Communicator& comm, const LayerShape& shape, const Config& config,
        const DeviceWeights& weights);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // out [T, H] bf16 (device) = the layer applied to this rank's x / topk_idx / topk_w (device
  // tensors, checked with validate_routing_layout). Enqueued on `stream`.
  // save_for_backward = false (inference, evaluation): the FC1 epilogues skip storing the gate/up
  // pre-activations a backward needs (2I bf16 per routed row: 0.5 GB of writes per forward at
  // DeepSeek-V3 T = 8192, EP 2; the buffer stays allocated); `out` is bitwise the same either
  // way. All ranks need not agree. A captured graph keeps the value it was captured with.
  // out: [T, H] bf16. Returns this forward's number (0, 1, 2, ... per layer), which backward()
  // takes: with config.saved_forwards = N the layer holds the saved state of the last N forwards.
  int64_t forward(const RoutingRefs& in, const TensorRef& out, cudaStream_t stream, bool save_for_backward = true);
  // Gradients of the last forward() given d_out [T, H] bf16 (device), enqueued on `stream`
  // (collective: every rank calls it, after the same forward). `in` must be the routing that
  // forward() used: its topk_w weight the reverse combine; its topk_idx is checked against the
  // forward's (a difference is named by check(); the forward's slots are used throughout); x is
  // not read (the forward's copy is: leave input_buffer() alone until the backward is done),
  // except with config.share_workspace, config.saved_forwards > 1 or config.precision fp8 / mxfp8, where
  // the backward stages `in.x` again (the x window is the workspace's, the last forward's, or holds
  // the forward's E4M3 codes): it must then be the forward's x in the caller's tensor, not
  // input_buffer() (refused by name). So does a backward over windows after a forward that read
  // the caller's x in place (see input_buffer()).
  // Needs the last forward() to have run with save_for_backward = true, once per forward (it
  // overwrites what the forward saved). With a megakernel ring below the worst case it runs over
  // windows of the ring: the routed x rows pulled again, FC1 recomputed for the rows past the
  // activation budget (config.activation_budget_bytes), the weight gradients carried across
  // windows in fp32 — the same bits as with every row resident (notes/memory.md). The weight gradients sum each
  // expert's rows in the schedule's order (fixed for a given routing): bitwise reproducible. The
  // first call allocates the backward's buffer (the routed dy rows): make it before capturing a
  // backward in a CUDA graph.
  // d_out: [T, H] bf16; grads: as DeviceGrads above (checked like every input). forward_id: the
  // forward's number (forward()'s result; -1 = the last forward); with config.saved_forwards = N
  // any of the last N forwards, in any order (microbatches, pipeline stages, recomputation), each
  // once — `in` must then be that forward's routing and x. Every rank must pass the same
  // forward (collective): the ranks compare their ids on the GPU, and check() names a difference
  // (backward.forward_id; that call's gradients are wrong).
  void backward(const RoutingRefs& in, const TensorRef& d_out, const DeviceGrads& grads, cudaStream_t stream,
                int64_t forward_id = -1);
  // This rank's x buffer [T, H] bf16 (device) inside the layer's symmetric window, which the
  // peers read during forward() (and backward() reads for the shared expert's weight gradients).
  // forward() copies RoutingRefs::x there unless x already points at it: write x here (rows
  // [0, T) only, ordered before forward() on its stream) to skip that copy. On one GPU (EP 1) the
  // bf16 megakernel without a shared expert reads a 16-byte aligned x in place and copies nothing. Valid for the layer's
  // lifetime; nullptr when T = 0. With config.share_workspace the window is shared by the layers
  // on the communicator (each forward and backward overwrites it).
  void* input_buffer() const;
  // Points later calls at other weight tensors (checked as the constructor's: shapes, this rank's
  // device, alignment, sizes). Host-side only (the kernels' tensor maps are re-encoded): calls
  // already enqueued, or captured in a CUDA graph, keep the weights they were given (FP8: see
  // the constructor).
  void set_weights(const DeviceWeights& weights);
  // Raises pending device-side errors (invalid routing: InvalidArgument naming topk_idx[t,j] or
  // topk_w[t,j]; a backward given other routing than its forward: InvalidArgument; expired waits,
  // here or on a peer: Timeout naming the wait and the rank). Call after synchronizing the stream.
  void check();
  // With MOK_PROFILE=1 in the environment when the layer was built: one line on where the last
  // forward's kernel spent its time (megakernel path) — compute CTAs busy in tiles / waiting for a
  // task / producer waiting on dependencies, comm CTAs pulling / pushing / idle — and, after a
  // backward(), one on the time of each of its stages (events on its stream); "" otherwise.
  // Synchronizes with the device.
  std::string profile_summary() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
