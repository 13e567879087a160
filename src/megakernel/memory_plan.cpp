#include <algorithm>
#include <vector>
#include <cstdio>

#include "megakernel/forward_setup.h"
#include "megakernel/fp8_backward_layout.h"
#include "mok/errors.hpp"
#include "mok/gemm_sizes.hpp"
#include "mok/memory.hpp"
#include "schedule/schedule_math.h"

namespace mok {

const char* to_string(MemoryScope s) {
  switch (s) {
    case MemoryScope::Layer: return "layer";
    case MemoryScope::Saved: return "saved";
    case MemoryScope::Backward: return "backward";
  }
  return "?";
}

int64_t MemoryPlan::bytes(const std::string& name) const {
  for (const BufferBytes& b : buffers)
    if (b.name == name) return b.bytes;
  throw Error(ErrorKind::Runtime, "memory plan", detail::concat("has no buffer '", name, "'"));
}

bool MemoryPlan::has(const std::string& name) const {
  return std::any_of(buffers.begin(), buffers.end(), [&](const BufferBytes& b) { return b.name == name; });
}

int64_t MemoryPlan::total() const {
  int64_t t = 0;
  for (const BufferBytes& b : buffers) t += b.bytes;
  return t;
}

int64_t MemoryPlan::total(MemoryScope scope) const {
  int64_t t = 0;
  for (const BufferBytes& b : buffers) t += b.scope == scope ? b.bytes : 0;
  return t;
}

int64_t MemoryPlan::workspace() const {
  int64_t t = 0;
  for (const BufferBytes& b : buffers) t += b.workspace ? b.bytes : 0;
  return t;
}

int64_t MemoryPlan::symmetric() const {
  int64_t t = 0;
  for (const BufferBytes& b : buffers) t += b.symmetric ? b.bytes : 0;
  return t;
}

const char* MemoryPlan::backward_mode() const {
  if (has("fp8_weights") && !has("fp8_bwd_rows")) return "none";  // the FP8 megakernel: forward only
  if (!has("bwd_carry")) return "resident";
  return has("gu_saved") ? "saved" : "recompute";
}

std::string MemoryPlan::table() const {
  std::vector<BufferBytes> sorted = buffers;
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  std::string out;
  char line[160];
  for (const BufferBytes& b : sorted) {
    std::snprintf(line, sizeof line, "  %-26s %12.3f MB  %-8s%s%s\n", b.name.c_str(), double(b.bytes) * 1e-6,
                  to_string(b.scope), b.symmetric ? " (symmetric window)" : "", b.workspace ? " (workspace)" : "");
    out += line;
  }
  std::snprintf(line, sizeof line, "  total %.3f GB: layer %.3f GB (of it saved for the backward %.3f GB), backward %.3f GB\n",
                double(total()) * 1e-9, double(total(MemoryScope::Layer) + total(MemoryScope::Saved)) * 1e-9,
                double(total(MemoryScope::Saved)) * 1e-9, double(total(MemoryScope::Backward)) * 1e-9);
  out += line;
  if (workspace() > 0) {
    std::snprintf(line, sizeof line, "  of it %.3f GB in the workspace the layers on the communicator share\n",
                  double(workspace()) * 1e-9);
    out += line;
  }
  return out;
}

// Without std::string concatenation (GCC 12's -Wrestrict false positive on it).
std::string slot_name(const char* base, int slot, bool always) {
  if (slot == 0 && !always) return base;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s#%d", base, slot);
  return buf;
}

MemoryPlan plan_memory(const LayerShape& shape, const Config& config, int rank, int sm_count) {
  config.validate(shape, sm_count);
  MOK_REQUIRE(rank >= 0 && rank < shape.world_size(), "rank", "must be in [0, W) (W = ", shape.world_size(),
              "), got ", rank);
  const bool fused = config.forward_path == ForwardPath::Megakernel;
  const bool push = fused && config.dispatch == DispatchPath::Push;
  const int W = shape.world_size();
  const int64_t H = shape.hidden, I = shape.intermediate, k = shape.top_k, e_loc = shape.local_experts();
  const int64_t Is = shape.shared_intermediate, T = shape.tokens_of(rank);
  const int64_t t_max = shape.max_tokens(), t_max_pad = sched::pad_rows(t_max);
  const int64_t cap = shape.worst_case_rows(), t_tiles = sched::ceil_div(T, sched::kBlockM);
  const auto at_least = [](int64_t v) { return std::max<int64_t>(v, 1); };
  MemoryPlan p;
  // The megakernel with a ring below the worst case runs the backward over windows of the ring's
  // size (notes/memory.md): gu and the dy rows hold one window, plus the wgrad carries and the
  // window arrays; the forward keeps the gate/up rows of the activation budget (gu_saved), the
  // backward recomputing FC1 for the others.
  const mk::ForwardSetup fs0 = fused ? mk::plan_forward(shape, config, rank, sm_count) : mk::ForwardSetup{};
  const bool windowed = fused && fs0.windowed;
  // FP8 / MXFP8 train on the unfused path (resident, layer_fp8_backward.cu) and on the megakernel
  // with a ring below the worst case (the backward over windows, as bf16's: the activation
  // budget's gate/up rows saved, FC1 again past it). Their megakernel with a resident ring is
  // forward only: nothing is saved for a backward there (what a bf16 forward saves is its own
  // working memory, scope Layer) and the backward's own buffers are not planned.
  const bool fp8 = config.precision != Precision::BF16;
  const bool fp8_forward_only = fp8 && fused && !windowed;
  const auto add = [&](std::string name, int64_t bytes, MemoryScope scope, bool symmetric = false) {
    if (fp8_forward_only && scope == MemoryScope::Backward) return;
    if (fp8_forward_only && scope == MemoryScope::Saved) scope = MemoryScope::Layer;
    // cudaMalloc'd buffers take at least 16 bytes (layer.cu's DeviceBuffer).
    p.buffers.push_back({std::move(name), symmetric ? bytes : std::max<int64_t>(bytes, 16), scope, symmetric});
  };
  using S = MemoryScope;
  // Symmetric windows: equal on every rank, sized by the largest T.
  // What a backward reads of its forward is Saved: the published routing, the schedule; and gu,
  // x and h rows unless it recomputes them. (The combine slots are not: the router-weight
  // gradient is <d_out . W_down, h>, from FC2's dgrad, not <d_out, y> of the forward's rows.)
  // (With several forwards alive each keeps a copy, routing#i, and the window is the next one's.)
  add("window.routing", at_least(t_max * k) * 4, config.saved_forwards > 1 ? S::Layer : S::Saved, true);
  add("window.x", at_least(t_max_pad * H) * 2, S::Layer, true);
  add("window.combine", at_least(t_max * k * H) * 2, S::Layer, true);
  // (recipe 1's training path at EP 1: d_out's 1 x 128 codes and scales after its rows,
  // fp8_backward_layout.h)
  add("window.d_out", fp8_bwd::dout_window(t_max_pad, H, fp8_bwd::dy_at_source(shape, config)).bytes, S::Layer, true);
  // The router weights, then (at router_call_offset) the backward's call words: its forward id
  // and the layer's number, which the peers compare (in the same window: no allocation of its own).
  add("window.router_weights", router_call_offset(t_max, k) + 16, S::Layer, true);
  add("window.d_weights", at_least(t_max * k) * 4, S::Layer, true);
  // The peers' addresses of the six windows and of the call words (W pointers each).
  add("peer_tables", 7 * std::max<int64_t>(16, int64_t(W) * 8), S::Layer);
  // The schedule (and, with push dispatch, every receiver's, built here too).
  int64_t chunks = 0;
  for (int r = 0; r < W; ++r) chunks += sched::ceil_div(shape.tokens_of(r) * k, sched::kBuilderChunk);
  const sched::BuilderSizes n = sched::builder_sizes(chunks, e_loc, W, cap);
  const int64_t one_schedule = n.total() * 4 + 16 /* totals */ + 16 /* abort snapshot */;
  add("schedule", one_schedule * (push ? W : 1), S::Saved);
  // Config::saved_forwards > 1: the saved state of each further forward alive ("<name>#<i>"), and
  // each forward's own copy of its published routing.
  const int slots = config.saved_forwards;
  for (int i = 1; i < slots; ++i) add(slot_name("schedule", i), one_schedule, S::Saved);
  if (slots > 1)
    for (int i = 0; i < slots; ++i) add(slot_name("routing", i, true), at_least(T * k) * 4, S::Saved);
  const int64_t bwd_rows = windowed ? fs0.ring_rows : std::max<int64_t>(cap, sched::kBlockM);
  // (FP8's FC1 stores them in bf16 as the bf16 FC1 does: on the unfused path all, on the
  // megakernel the activation budget's, and over windows FC1 again the rest.)
  if (!fp8_forward_only) add("gu", bwd_rows * 2 * I * 2, windowed ? S::Layer : S::Saved);
  for (int i = 0; i < slots; ++i) {
    if (windowed && fs0.saved_rows > 0)
      add(slot_name("gu_saved", i), fs0.saved_rows * 2 * I * 2, S::Saved);
    if (Is > 0 && T > 0) {
      add(slot_name("gu_s", i), t_tiles * 128 * 2 * Is * 2, S::Saved);
      add(slot_name("h_s", i), t_tiles * 128 * Is * 2, S::Saved);
    }
  }
  if (Is > 0 && T > 0) {
    add("y_s", t_tiles * 128 * H * 2, S::Layer);
  }
  // FP8: the weights' E4M3 codes and their 128 x 128 fp32 scales; h and the x window hold codes and
  // scales in the bf16 buffers' bytes, x_routed is codes-sized (below; layer_fp8.cu).
  if (config.precision != Precision::BF16) {
    const char* p8 = to_string(config.precision);
    MOK_REQUIRE(H % 128 == 0, "shape.hidden", "must be a multiple of 128 with config.precision ", p8, ", got ", H);
    MOK_REQUIRE(I % 128 == 0, "shape.intermediate", "must be a multiple of 128 with config.precision ", p8, ", got ",
                I);
  }
  if (fp8) add("fp8_weights", 3 * e_loc * I * H + 3 * e_loc * (I / 128) * (H / 128) * 4, S::Layer);
  if (fused) {
    const mk::ForwardSetup& fs = fs0;
    const int64_t R = fs.ring_rows;
    // Saved for a resident backward; a backward over windows fills it again. h is not saved: FC2's
    // dgrad computes it from the gate/up rows (and writes the weighted h there).
    add("x_ring", R * H * 2, windowed ? S::Layer : S::Saved, push);
    add("h_ring", R * I * 2, S::Layer);
    add("y_ring", R * H * 2, S::Layer);
    if (push) {
      add("counters", int64_t(fs.widest.words()) * 4, S::Layer, true);
      // Every receiver's schedule view (64 bytes), ring and counter addresses.
      add("push_peer_tables", std::max<int64_t>(16, int64_t(W) * 64) + 2 * std::max<int64_t>(16, int64_t(W) * 8),
          S::Layer);
    } else {
      add("counters", int64_t(fs.layout.words()) * 4, S::Layer);
    }
    // 2-CTA clusters: rank 0 hands rank 1 its tasks through global slots (the grid is at most
    // the SM count).
    if (fs.cluster) add("cluster_slots", mk::forward_cluster_slot_bytes(sm_count), S::Layer);
  } else {
    // FP8: codes then 1 x 128 scales, read by FC1 only (the FP8 backward reads x in the windows).
    if (fp8)
      add("x_routed", cap * H + cap * (H / 128) * 4, S::Layer);
    else
      add("x_routed", cap * H * 2, S::Saved);
    add("h", cap * I * 2, S::Layer);
    add("y", cap * H * 2, S::Layer);
    if (Is > 0 && T > 0) add("shared_tiles", t_tiles * 4, S::Layer);
  }
  const int64_t dy_rows = windowed ? bwd_rows : cap;
  // (FP8 recipe 1 pulls d_y as codes made at its source: no routed bf16 copy; fp8_backward_layout.h)
  if (!(fp8 && fp8_bwd::dy_at_source(shape, config))) add("dy_rows", dy_rows * H * 2, S::Backward);
  add("row_weights", dy_rows * 4, S::Backward);
  add("router_partials", dy_rows * gemm::router_parts(I) * 4, S::Backward);
  // The backward's GEMM program: its ticket, then per M tile of a window its D2 reports.
  if (config.backward_path == BackwardPath::Fused)
    add("bwd_counters", (1 + dy_rows / sched::kBlockM) * 4, S::Backward);
  if (windowed) {
    // Two of each (a window reads the previous one's and writes its own: WgradArgs::carry_in / out).
    add("bwd_carry", 2 * (gemm::wgrad_carry_floats(H, I) + gemm::wgrad_carry_floats(2 * I, H)) * 4, S::Backward);
    add("bwd_windows", (2 * e_loc + sched::kWindowEndWords) * 4, S::Backward);  // (gpu::window_parts)
  }
  // FP8's backward operands (src/megakernel/fp8_backward_layout.h): the routed rows' codes, and the
  // dgrads' K-major weight codes made by each call.
  if (fp8) {
    add("fp8_bwd_rows", fp8_bwd::rows_layout(bwd_rows, H, I).bytes, S::Backward);
    // Kept (Config::fp8_keep_weight_codes_t): the layer's own, made with the forward's codes.
    add("fp8_bwd_weights", fp8_bwd::weights_layout(e_loc, H, I).bytes,
        config.fp8_keep_weight_codes_t ? S::Layer : S::Backward);
  }
  if (Is > 0 && T > 0) {
    add("shared_rows", 8, S::Backward);
    if (fused) add("shared_tiles", t_tiles * 4, S::Backward);
  }
  if (config.share_workspace) {
    // The buffers no later call reads from this one's (Config::share_workspace): the FC2 rows
    // (the backward writes its d_x rows there), the backward's dy rows; with a backward over
    // windows also what it fills again (the rings, gu, the carries and the window arrays). A
    // push-dispatch ring is a symmetric window the peers write: the layer's own (its counters too).
    // The symmetric windows but the published routing too: the backward stages x and d_out again
    // and reads no row the forward left in the combine slots.
    std::vector<std::string> shared = {"y_ring", "y", "y_s", "h_ring", "h", "dy_rows", "row_weights", "router_partials", "bwd_counters",
                                       "fp8_bwd_rows",
                                       "window.x", "window.combine", "window.d_out", "window.router_weights",
                                       "window.d_weights"};
    if (fp8) shared.emplace_back("x_routed");
    if (fp8 && !config.fp8_keep_weight_codes_t) shared.emplace_back("fp8_bwd_weights");
    if (windowed) {
      for (const char* name : {"gu", "bwd_carry", "bwd_windows"}) shared.emplace_back(name);
      if (!push) shared.emplace_back("x_ring");
    }
    for (BufferBytes& b : p.buffers)
      b.workspace = std::find(shared.begin(), shared.end(), b.name) != shared.end();
  }
  // (layer_backward_windows.cu: the held expert's x, d_y and weighted h rows, in the gu scratch)
  if (windowed && fs0.saved_rows > 0 && config.precision == Precision::BF16 &&
      config.backward_path == BackwardPath::Unfused)
    p.hold_rows = std::min(fs0.ring_rows, p.bytes("gu") / (4 * H + 2 * I) / sched::kBlockM * sched::kBlockM);
  return p;
}

int64_t default_workspace_budget(const LayerShape& shape, const Config& config) {
  constexpr int64_t kRows = 2000000000;
  if (config.precision == Precision::BF16 || config.fp8_keep_weight_codes_t) return kRows;
  return kRows + fp8_bwd::weights_layout(shape.local_experts(), shape.hidden, shape.intermediate).bytes;
}

int64_t ring_for_workspace(const LayerShape& shape, const Config& config, int rank, int sm_count,
                           int64_t budget_bytes) {
  Config cfg = config;
  cfg.share_workspace = true;
  cfg.macrobatch_tokens = 0;
  cfg.workspace_budget_bytes = 0;  // the rings tried below are explicit (Config::resolved_macrobatch calls this)
  cfg.validate(shape, sm_count);
  const int64_t mb = cfg.resolved_minibatch(shape, sm_count), cap = shape.worst_case_rows();
  // The automatic ring is the worst case capped by 32-bit offsets: never more than that.
  const int64_t limit = std::min(cfg.resolved_macrobatch(shape, sm_count), cap - 1);
  if (limit < 2 * mb) return 0;
  // The workspace grows with the ring (the rings, gu and the dy rows are R rows; the windows and
  // carries are fixed): the last ring within the budget, walking up one minibatch at a time.
  int64_t best = 0, smallest = 0;
  // The workspace of `rank`, or (rank < 0) the largest over the ranks: the ring must be the same on
  // all of them, and a rank's shared-expert rows (its tokens) are part of its workspace.
  const auto workspace = [&]() {
    int64_t ws = 0;
    for (int r = rank < 0 ? 0 : rank; r < (rank < 0 ? shape.world_size() : rank + 1); ++r)
      ws = std::max(ws, plan_memory(shape, cfg, r, sm_count).workspace());
    return ws;
  };
  for (int64_t r = 2 * mb; r <= limit; r += mb) {
    cfg.macrobatch_tokens = r;
    const int64_t ws = workspace();
    if (smallest == 0) smallest = ws;
    if (ws > budget_bytes) break;
    best = r;
  }
  MOK_REQUIRE(best > 0, "workspace_budget", "the smallest ring (2 minibatches of ", mb, " rows) needs a ",
              smallest, "-byte workspace, more than the budget of ", budget_bytes, " bytes");
  return best;
}

}  // namespace mok
