// mok — layer shape and run-time configuration.
//
// LayerShape describes one expert-parallel MoE layer as every rank of the EP group sees it; all
// ranks must hold the same LayerShape (the communicator's handshake checks this). Config holds the
// knobs of the megakernels. Both validate themselves and throw mok::Error naming the field and the
// violated constraint.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mok {

enum class Precision {
  BF16,     // bf16 operands, fp32 accumulation (the reference precision)
  FP8,      // block-scaled E4M3: 1x128 activation blocks, 128x128 weight blocks, fp32 scales
  MXFP8,    // OCP MX E4M3 + E8M0 per 32, re-blocked to 1x128 power-of-two scales on Hopper
};

const char* to_string(Precision p);

struct LayerShape {
  // Tokens per rank; entry r is T on EP rank r. May differ between ranks and may be 0.
  std::vector<int64_t> tokens;
  int64_t hidden = 0;               // H, multiple of 64
  int64_t intermediate = 0;         // I of a routed expert, multiple of 64
  int64_t experts = 0;              // E, total routed experts, divisible by world_size
  int64_t top_k = 0;                // k, 1 <= k <= E
  int64_t shared_intermediate = 0;  // Is of the shared expert, 0 = no shared expert

  int world_size() const { return static_cast<int>(tokens.size()); }
  int64_t local_experts() const { return experts / world_size(); }
  int64_t tokens_of(int rank) const { return tokens.at(static_cast<size_t>(rank)); }
  int64_t total_tokens() const;
  int64_t max_tokens() const;
  // Worst-case routed rows one rank may receive: every route of every rank lands on it, plus
  // per-expert padding to the GEMM tile height. Buffers are sized by this, so no routing can
  // overflow them (imbalance costs time, never correctness).
  int64_t worst_case_rows() const;

  // Throws mok::Error for the first violated constraint (argument names like "shape.hidden").
  void validate() const;

  // Convenience: the same T on every rank.
  static LayerShape uniform(int world_size, int64_t tokens_per_rank, int64_t hidden,
                            int64_t intermediate, int64_t experts, int64_t top_k,
                            int64_t shared_intermediate = 0);
};

// How the GPU layer runs the forward: the persistent megakernel, or the unfused sequence of
// kernels (pull dispatch, grouped FC1, grouped FC2, push combine) kept as baseline and fallback.
enum class ForwardPath { Megakernel, Unfused };
const char* to_string(ForwardPath p);
// Who sends FC2 rows back to their owners in the megakernel: the comm CTAs (FC2 stores its tile
// into the ring, a comm CTA pushes each finished minibatch), or the FC2 epilogue itself (each
// row straight from the tile into the owner's combine slot; the comm CTAs only pull).
enum class CombinePath { CommCtas, Fc2Epilogue };
const char* to_string(CombinePath p);
// How routed rows reach the experts' ranks in the megakernel: each rank's comm CTAs pull the
// rows it needs from the owners' x (reads over NVLink), or each rank's comm CTAs push its own
// tokens into the receivers' rings (writes over NVLink; the ring and the readiness counters
// then live in symmetric windows, and every rank also builds the receivers' schedules).
enum class DispatchPath { Pull, Push };
const char* to_string(DispatchPath p);
// How the GPU layer's backward runs its four GEMMs (FC2 dgrad + SwiGLU', FC1 dgrad, the two
// weight gradients) over a window of rows: four kernels one after the other, or one persistent
// kernel (the backward's GEMM program, src/megakernel/backward_program.h) whose tiles wait only
// for the tiles they read, so the weight gradients run beside FC1's dgrad. The same bits either
// way; the movement (reverse combine, reverse dispatch) runs in its own kernels in both.
enum class BackwardPath { Unfused, Fused };
const char* to_string(BackwardPath p);

struct Config {
  ForwardPath forward_path = ForwardPath::Megakernel;  // GPU layer only (the CPU reference ignores it)
  CombinePath combine = CombinePath::CommCtas;         // megakernel only
  DispatchPath dispatch = DispatchPath::Pull;          // megakernel only
  BackwardPath backward_path = BackwardPath::Unfused;  // GPU layer only
  // Megakernel only: compute SMs work in pairs (2-CTA clusters) on two M tiles of one expert and
  // share each weight tile (TMA multicast), halving weight traffic from L2; fwd_comm_sms must be
  // even. Off: every compute SM loads its own weight tiles.
  bool fwd_clusters = false;
  // CTAs (one per SM) that move tokens in the forward kernel; 0 = from the shape: ~16384 / I,
  // rounded to 4 in [4, 32] (halved with the FC2-epilogue combine), at most 16 for the megakernel
  // on one GPU (local copies); the unfused path's movement kernels take it as their grid.
  int fwd_comm_sms = 0;
  int bwd_comm_sms = 16;             // EP > 1: CTAs of the backward's pushes, run beside its weight
                                     // gradients (which leave these SMs free)
  int64_t minibatch_tokens = 0;      // routed rows per minibatch; 0 = choose from the shape
  int64_t macrobatch_tokens = 0;     // routed rows held by the ring buffer; 0 = worst case (no ring reuse)
  // Megakernel with a ring below the worst case (the backward then runs over windows of the ring):
  // the bytes of FC1 pre-activations (gate/up rows, 4I bytes each) a forward keeps for its
  // backward, in the schedule's row order; the backward recomputes FC1 for the rows past them
  // (skewed routing), so memory is fixed whatever the routing and the gradients are the same bits.
  // -1 = automatic (the rows a uniform routing lands on this rank, plus an eighth and each
  // expert's padding: imbalance is recomputed, not stored); 0 = full recompute (nothing saved).
  // Rounded down to whole 128-row tiles and capped at the worst case. Ignored when the ring holds
  // the worst case (every row is then resident).
  int64_t activation_budget_bytes = -1;
  // Forwards whose saved state a layer holds at once (microbatches, pipeline stages, activation
  // checkpointing: several forwards before their backwards). Each holds its routing, schedule,
  // the activation budget's gate/up rows and the shared expert's activations; forward() returns
  // its number and backward() takes it. More than 1 needs the megakernel with pull dispatch and a
  // ring below the worst case (a resident backward's saved state is the ring itself).
  int saved_forwards = 1;
  Precision precision = Precision::BF16;
  // FP8 training on the GPU layer (precision FP8 or MXFP8; forward_path unfused, or the megakernel
  // with a ring below the worst case, whose backward runs over windows): the backward's K-major
  // weight codes (W_down^T and the packed [W_gate; W_up]^T, 128 x 128 blocks: half the bf16
  // weight bytes) are made with the forward's by the weight binding (construction, set_weights)
  // and kept by the layer, instead of by every backward into the shared workspace. Per backward
  // that saves a pass over the bf16 weights (~1.5 ms for a DeepSeek-V3 EP-8 rank's layer at the
  // power cap), which the binding then makes once per weight update: it pays with several
  // microbatches per update. It holds 1.41 GB per such layer (x 58 layers: 82 GB): off by default.
  bool fp8_keep_weight_codes_t = false;
  double wait_timeout_s = 5.0;       // bound of every device-side spin-wait
  int cpu_threads = 0;               // CPU reference engine: worker threads, 0 = hardware concurrency
  // GPU layer: the buffers a call uses and leaves nothing in for a later call (the FC2 rows, the
  // backward's dy rows, the symmetric windows but the routing's — x, combine slots, d_out, router
  // weights and their gradient —; with a backward over windows also the rings, gu and the wgrad
  // carries) are one workspace shared by every layer on the communicator with this setting (calls on a
  // communicator run one at a time; CUDA graphs of two such layers must not be replayed at once),
  // sized when a layer is built: a later layer that needs more gets a new buffer, which the
  // layers after it share while the earlier ones keep theirs (build the largest layer first).
  // The planner marks them (workspace). The same on every rank (the shared windows are collective;
  // the layer's handshake compares it). Off: every layer has
  // its own.
  bool share_workspace = true;
  // Megakernel with share_workspace: the shared workspace's budget in bytes, which then sizes the
  // ring (macrobatch_tokens left 0: mok::ring_for_workspace picks the largest ring whose workspace
  // fits, and the backward runs over windows of it) — the training memory model in one setting
  // (notes/memory.md). -1 = automatic: 2 GB where it applies (share_workspace, the megakernel,
  // macrobatch_tokens 0; in FP8 / MXFP8 plus the backward's K-major weight codes, which are
  // made per call into the workspace and hold the same bytes whatever the ring:
  // mok::default_workspace_budget), nothing elsewhere; 0 = off (the ring is macrobatch_tokens, or the worst
  // case: every routed row resident).
  int64_t workspace_budget_bytes = -1;

  // Throws mok::Error for the first violated constraint. `sm_count` (0 = unknown, e.g. on a
  // machine without GPU) bounds the comm SM counts (at least one SM must remain for compute) and
  // is the SM count the minibatch and ring are checked with.
  void validate(const LayerShape& shape, int sm_count = 0) const;

  // Resolved values (defaults filled in from the shape). `sm_count`: the device's SMs, which the
  // minibatch's two-wave rule counts (0 = the target parts' 132; the layer passes the real count).
  int resolved_fwd_comm_sms(const LayerShape& shape) const;
  int64_t resolved_minibatch(const LayerShape& shape, int sm_count = 0) const;
  int64_t resolved_macrobatch(const LayerShape& shape, int sm_count = 0) const;
  // Rows of FC1 pre-activations a forward keeps for a backward over windows
  // (activation_budget_bytes resolved): a multiple of 128 in [0, worst_case_rows()].
  int64_t resolved_saved_rows(const LayerShape& shape) const;
};

}  // namespace mok
