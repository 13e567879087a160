// mok_bench's GPU mode: the layer on all visible GPUs at the model shapes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/workload.hpp"

namespace mok::bench {

struct GpuBenchOptions {
  // A model, or "<model>/ep8": the per-rank slice of EP 8 (E / 8 experts per GPU at the same
  // tokens per GPU, so each GPU computes what one rank of an 8-GPU node does; "slice_of_ep" in
  // the JSON).
  std::vector<std::string> models = {"dsv3",        "qwen3-30b-a3b",     "qwen3-235b",
                                     "dsv3/ep8",    "qwen3-30b-a3b/ep8", "qwen3-235b/ep8"};
  std::vector<int64_t> tokens = {2048, 8192};
  std::vector<Routing> routings = {Routing::Uniform, Routing::Zipf};
  int warmup = 5;
  int iters = 20;
  int comm_sms = 0;  // 0 = chosen from the shape (Config::resolved_fwd_comm_sms)
  int64_t minibatch = 0;  // the main variant's Config::minibatch_tokens (0 = chosen from the shape)
  // The main variant's ring (Config::macrobatch_tokens, routed rows; 0 = the default; rounded up
  // to a multiple of each case's minibatch). Below the worst case its backward runs over windows.
  int64_t macrobatch = 0;
  int64_t budget_mb = -1;  // the main variant's Config::activation_budget_bytes in MB (-1 = automatic)
  // > 0: the main variant shares its workspace (Config::share_workspace) and runs the ring that
  // fits this many MB of it (mok::ring_for_workspace), in place of `macrobatch`; 0: off (its own
  // buffers, every routed row resident unless `macrobatch`); -1: the library's default (a shared
  // 2 GB workspace where it applies: Config::workspace_budget_bytes = -1).
  int64_t workspace_budget_mb = -1;
  ForwardPath path = ForwardPath::Megakernel;  // the variant reported in `cases`
  int clusters = -1;  // main variant's Config::fwd_clusters: 0 / 1, -1 = the Config default
  DispatchPath dispatch = DispatchPath::Pull;  // main variant's Config::dispatch
  BackwardPath backward_path = BackwardPath::Unfused;  // main variant's Config::backward_path
  // The main variant's Config::precision. FP8 (recipe 1): no ablation; the megakernel forward only,
  // the unfused path forward and backward (its backward checked against the bf16 spec within the
  // recipe's error); the forward's sampled check is against the spec's FP8 forward.
  Precision precision = Precision::BF16;
  bool fp8_keep_weight_codes_t = false;  // the main variant's Config::fp8_keep_weight_codes_t
  // Ablation: besides the main variant, at every shape: the other path, comm SMs {4, 8, 16, 32}, half and
  // double the minibatch, the combine in the FC2 epilogue, the other cluster setting, the other
  // dispatch (pull / push), and a ring of 4 minibatches; each checked bitwise against the main one.
  // With the backward on and a main variant with every row resident, also the training memory
  // model's two modes (a 2 GB shared workspace and its ring; the automatic activation budget, and
  // full recompute), their backward timed and checked against the spec like the main one's; and
  // the other backward path (Config::backward_path) of the main variant and of the saved mode.
  bool ablation = true;
  // When not empty: the ablation variants kept (by name, e.g. megakernel-bwd-accumulate); the main
  // variant always runs. A name that matches no variant of a shape is reported, not an error.
  std::vector<std::string> variants;
  // Sustained rate of the main variant: after all variants of a shape, about `sustain_s` seconds
  // of back-to-back forwards (the count is fixed from the shape's FLOPs, equal on every rank), the
  // slowest rank's mean time per forward over the second half. Under load the GPU runs at its
  // power cap with a clock that swings over ~1 s; the 20-iteration median is partly measured
  // before that (0 = off).
  double sustain_s = 4.0;
  // Backward of the main variant after its forward timing: a sampled check of d_x and d_topk_w
  // against the spec's arithmetic, then per iteration forward (untimed) + backward (timed), the
  // slowest rank's median. Skipped (with a note) when the main variant's ring cannot hold every
  // routed row.
  bool backward = true;
  std::string json;  // results file ("" = none)
};

// Returns 0 on success; throws mok::Error on bad options or device failures.
int run_gpu_layer_bench(const GpuBenchOptions& o);

}  // namespace mok::bench
