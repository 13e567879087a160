// mok — the GPU layer's device memory, planned without a GPU: every buffer one rank's mok::Layer
// allocates, with its bytes, whether it is a symmetric window (NCCL memory the peers address) and
// when it is allocated. mok::Layer allocates exactly these sizes (src/megakernel/layer.cu asks the
// plan), so the plan is the footprint: mok_bench reports it per case, and a GPU test compares it
// with the device's free memory before and after a layer.
//
// Names: window.{routing, x, combine, d_out, router_weights (+ the backward's call words), d_weights},
// peer_tables, schedule, gu (gate/up
// pre-activations; gu_saved: the rows of the activation budget a forward keeps for a backward
// over windows), the shared expert's gu_s, h_s, y_s,
// the megakernel's x_ring, h_ring, y_ring, counters (push_peer_tables with push dispatch;
// cluster_slots with 2-CTA clusters), the unfused path's x_routed, h, y (fp8_weights with
// Config::precision FP8 or MXFP8), and the backward's dy_rows (not in FP8 at EP 1, which pulls d_y
// as codes made at the source), row_weights, router_partials
// (shared_rows, shared_tiles). With Config::saved_forwards = N > 1 the saved state of forward
// slots 1 .. N-1 is listed under slot_name(): schedule#i, gu_saved#i, gu_s#i, h_s#i, and every
// slot's copy of its routing, routing#i.
//
// The model. The weights are read where the caller keeps them (no copy). With the default
// Config every buffer belongs to one layer and the ring holds the worst case of the routing
// (every route of every rank landing on this rank): the backward finds every routed row of its
// forward resident. A megakernel ring below the worst case makes the backward run over windows of
// the ring (notes/memory.md): x rows pulled again, the gate/up rows of the activation budget read
// from the forward (gu_saved, Config::activation_budget_bytes), FC1 recomputed past it, the
// weight gradients carried across windows (bwd_carry, bwd_windows); gu and the dy rows then hold
// one window. Config::share_workspace puts what no later call reads (the rings and windows' rows,
// the symmetric windows but the routing's) into one workspace per communicator (`workspace`
// below; ring_for_workspace sizes the ring for a budget), so a layer keeps only the routing, the
// schedule and the budget's gate/up rows between its forward and its backward. Scopes:
//   Layer     allocated when the layer is built, held for its life;
//   Saved     part of Layer: what a backward reads of the last forward (the published routing,
//             the schedule, and the routed x rows and gate/up pre-activations unless the backward
//             recomputes them; h it computes from the gate/up rows), one forward's worth per layer;
//   Backward  allocated by the layer's first backward() and held from then on.
// Weights, inputs and outputs (the caller's tensors) are not counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/config.hpp"

namespace mok {

enum class MemoryScope { Layer, Saved, Backward };
const char* to_string(MemoryScope s);

struct BufferBytes {
  std::string name;
  int64_t bytes = 0;
  MemoryScope scope = MemoryScope::Layer;
  bool symmetric = false;  // a symmetric window (ncclMemAlloc), not cudaMalloc
  // In the workspace shared by the layers on a communicator (Config::share_workspace): the
  // layers with this shape together hold it once.
  bool workspace = false;
};

struct MemoryPlan {
  std::vector<BufferBytes> buffers;
  // The bytes of buffer `name`; throws mok::Error naming it when the plan has no such buffer.
  int64_t bytes(const std::string& name) const;
  bool has(const std::string& name) const;
  int64_t total() const;                  // every buffer, the backward's included
  int64_t total(MemoryScope scope) const;
  int64_t symmetric() const;
  int64_t workspace() const;              // the buffers in the shared workspace
  int64_t per_layer() const { return total() - workspace(); }
  std::string table() const;              // one line per buffer, largest first, and the totals
  // How the backward gets the forward's rows: "resident" (every routed row kept: the unfused path
  // or a ring of the worst case), "saved" (over windows of the ring, the activation budget's
  // gate/up rows kept), "recompute" (over windows, FC1 recomputed for every row); "none" for the
  // FP8 megakernel, which is forward only (nothing saved, no backward buffers planned).
  const char* backward_mode() const;
  // The backward over windows: the most rows of an expert cut by a window's end that it holds over
  // into the next window instead of carrying its fp32 weight-gradient sums (bf16 with the four GEMM
  // kernels and an activation budget: the rows live in the gu scratch, which the saved windows
  // leave unused, so they cost no bytes here). 0: every cut expert is carried.
  int64_t hold_rows = 0;
};

// Byte offset of the backward's call words (its forward id and the layer's number, two int64)
// inside window.router_weights: after the [T_max, k] f32 weights, 16-aligned.
constexpr int64_t router_call_offset(int64_t t_max, int64_t top_k) {
  return ((t_max * top_k > 0 ? t_max * top_k : 1) * 4 + 15) / 16 * 16;
}

// The plan's name of forward slot `slot`'s buffer `base` (Config::saved_forwards > 1): "<base>#<slot>",
// slot 0 being "<base>" itself unless `always`.
std::string slot_name(const char* base, int slot, bool always = false);

// One rank's plan for `shape` and `config` on a GPU with `sm_count` SMs (0 = the target parts'
// 132; the minibatch, and so the ring, depends on it). Throws mok::Error for what cannot run (as
// the layer would).
MemoryPlan plan_memory(const LayerShape& shape, const Config& config, int rank, int sm_count = 0);

// The ring for a workspace budget: the largest Config::macrobatch_tokens below the worst case (a
// multiple of the minibatch, at least two of them: the backward then runs over windows) whose
// plan, with `config`'s other settings and share_workspace on, keeps the workspace within
// `budget_bytes`. 0 (automatic) when the worst case is within two minibatches anyway. Throws
// mok::Error naming "workspace_budget" when even the smallest ring's workspace exceeds it.
int64_t ring_for_workspace(const LayerShape& shape, const Config& config, int rank, int sm_count,
                           int64_t budget_bytes);

// The automatic workspace budget (Config::workspace_budget_bytes = -1): 2 GB, plus in FP8 / MXFP8
// the backward's per-call K-major weight codes (a fixed size that no ring makes smaller: without
// it the budget would leave the FP8 rings a fraction of the bf16 ones').
int64_t default_workspace_budget(const LayerShape& shape, const Config& config);

}  // namespace mok
