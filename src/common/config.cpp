#include "mok/config.hpp"

#include <algorithm>
#include <limits>

#include "mok/errors.hpp"
#include "mok/memory.hpp"
#include "schedule/schedule_math.h"

namespace mok {

namespace {
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// Kernels index the routed, combine and routing buffers with 32-bit element offsets (weights use
// 64-bit offsets). These are the shapes for which that is safe.
bool fits_int32(int64_t a, int64_t b) { return a == 0 || b <= kInt32Max / a; }
// SMs of the target parts (H100/H200 SXM) used for defaults when no device is known.
constexpr int kDefaultSmCount = 132;
}  // namespace

const char* to_string(ForwardPath p) {
  return p == ForwardPath::Megakernel ? "megakernel" : "unfused";
}

const char* to_string(CombinePath p) {
  return p == CombinePath::CommCtas ? "comm-ctas" : "fc2-epilogue";
}

const char* to_string(DispatchPath p) { return p == DispatchPath::Pull ? "pull" : "push"; }

const char* to_string(BackwardPath p) { return p == BackwardPath::Unfused ? "unfused" : "fused"; }

const char* to_string(Precision p) {
  switch (p) {
    case Precision::BF16: return "bf16";
    case Precision::FP8: return "fp8";
    case Precision::MXFP8: return "mxfp8";
  }
  return "?";
}

int64_t LayerShape::total_tokens() const {
  int64_t s = 0;
  for (int64_t t : tokens) s += t;
  return s;
}

int64_t LayerShape::max_tokens() const {
  int64_t m = 0;
  for (int64_t t : tokens) m = std::max(m, t);
  return m;
}

int64_t LayerShape::worst_case_rows() const {
  return sched::worst_case_rows(total_tokens() * top_k, local_experts());
}

LayerShape LayerShape::uniform(int world_size, int64_t tokens_per_rank, int64_t hidden,
                               int64_t intermediate, int64_t experts, int64_t top_k,
                               int64_t shared_intermediate) {
  LayerShape s;
  s.tokens.assign(static_cast<size_t>(std::max(world_size, 0)), tokens_per_rank);
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.experts = experts;
  s.top_k = top_k;
  s.shared_intermediate = shared_intermediate;
  return s;
}

void LayerShape::validate() const {
  const int64_t W = static_cast<int64_t>(tokens.size());
  MOK_REQUIRE(W >= 1, "shape.tokens", "one entry per EP rank is required (world size >= 1), got ", W,
              " entries");
  MOK_REQUIRE(W <= sched::kMaxWorldSize, "shape.tokens", "EP world size must be <= ",
              sched::kMaxWorldSize, ", got ", W);
  for (int64_t r = 0; r < W; ++r) {
    MOK_REQUIRE(tokens[static_cast<size_t>(r)] >= 0, "shape.tokens",
                "tokens per rank must be >= 0, rank ", r, " has ", tokens[static_cast<size_t>(r)]);
  }
  MOK_REQUIRE(hidden > 0 && hidden % 64 == 0, "shape.hidden",
              "H must be a positive multiple of 64, got ", hidden);
  MOK_REQUIRE(intermediate > 0 && intermediate % 64 == 0, "shape.intermediate",
              "I must be a positive multiple of 64, got ", intermediate);
  MOK_REQUIRE(shared_intermediate >= 0 && shared_intermediate % 64 == 0,
              "shape.shared_intermediate",
              "Is must be 0 (no shared expert) or a positive multiple of 64, got ",
              shared_intermediate);
  MOK_REQUIRE(experts >= 1, "shape.experts", "E must be >= 1, got ", experts);
  MOK_REQUIRE(experts % W == 0, "shape.experts", "E must be divisible by the EP world size (E = ",
              experts, ", W = ", W, ")");
  MOK_REQUIRE(top_k >= 1, "shape.top_k", "k must be >= 1, got ", top_k);
  MOK_REQUIRE(top_k <= experts, "shape.top_k", "k must be <= E (k = ", top_k, ", E = ", experts,
              ")");
  MOK_REQUIRE(top_k <= sched::kMaxTopK, "shape.top_k", "k must be <= ", sched::kMaxTopK, ", got ",
              top_k);
  // 32-bit indexing limits (see fits_int32).
  const int64_t routes = total_tokens() * top_k;
  MOK_REQUIRE(fits_int32(total_tokens(), top_k) && worst_case_rows() <= kInt32Max, "shape.tokens",
              "all ranks' routes (sum of T times k = ", routes,
              ") and the worst-case routed rows must fit 32-bit indexing (< 2^31)");
  for (int64_t r = 0; r < W; ++r) {
    const int64_t t = tokens[static_cast<size_t>(r)];
    MOK_REQUIRE(fits_int32(t * top_k, hidden), "shape.tokens",
                "rank ", r, ": the combine buffer T*k*H = ", t, "*", top_k, "*", hidden,
                " elements must fit 32-bit indexing (< 2^31)");
  }
}

int Config::resolved_fwd_comm_sms(const LayerShape& shape) const {
  if (fwd_comm_sms > 0) return fwd_comm_sms;
  // Movement per routed row is ~4H bytes (pull + push), compute 6HI FLOPs: the comm share of the
  // SMs scales with 1/I. Fitted on 2xH200 (bench/results/forward-h200x2.json, comm SM sweep):
  // best at 8 for I = 2048 (DeepSeek-V3), 12-16 for I = 1536 and 16-32 for I = 768; one TMA-driven
  // comm SM moves ~50-100 GB/s. Multiple of 4, within [4, 32].
  // With the combine in the FC2 epilogue the comm CTAs only pull: half the bytes.
  const int64_t per = combine == CombinePath::Fc2Epilogue ? 8192 : 16384;
  const int64_t sms = sched::round_up(per / std::max<int64_t>(1, shape.intermediate), 4);
  // The megakernel on one GPU: its comm CTAs' pulls and pushes are local copies, with no link
  // latency to cover by bytes in flight, and the SMs they leave compute: at most 16. Measured on one
  // H100 (EP 1, every row resident, movers without rounds; bench/results/fwd-comm-sms-ep1-h100x1.json):
  // Qwen3-30B-A3B T 8192 0.967x / 0.974x with 16 instead of 24 (uniform / Zipf; T 2048 1.007x), 12
  // worse (1.04-1.12x); DeepSeek-V3's 8 and Qwen3-235B's 12 (8: 1.039x) stay. The unfused path's
  // movement kernels, which run alone, keep the rule's grid; so do mok_bench's EP-8 slices (the
  // EP-8 rank's value).
  const int64_t cap = shape.world_size() == 1 && forward_path == ForwardPath::Megakernel ? 16 : 32;
  return static_cast<int>(std::clamp<int64_t>(sms, 4, cap));
}

int64_t Config::resolved_minibatch(const LayerShape& shape, int sm_count) const {
  if (minibatch_tokens > 0) return minibatch_tokens;
  // MoK's rule: each GEMM of a minibatch gets >= 2 full waves of 128x256 tiles over the compute
  // SMs, the narrower of FC1 (N = 2I) and FC2 (N = H) deciding. But the last minibatch's FC2 runs
  // with nothing to overlap, so when a rank has few routed rows the minibatch shrinks to about
  // 1/16 of them, down to one wave. Measured on 2xH200 (bench/results/forward-h200x2.json,
  // minibatch sweep): T = 2048 runs 5-12% faster at half the two-wave size, T = 8192 best at it.
  const int64_t sms = sm_count > 0 ? sm_count : kDefaultSmCount;
  const int64_t compute_sms = std::max<int64_t>(1, sms - resolved_fwd_comm_sms(shape));
  const int64_t n = std::min(2 * shape.intermediate, shape.hidden);
  const int64_t one_wave = sched::round_up((compute_sms * 128 * 256 + n - 1) / n, sched::kBlockM);
  const int64_t two_waves = sched::round_up((2 * compute_sms * 128 * 256 + n - 1) / n, sched::kBlockM);
  const int64_t routes_per_rank = shape.total_tokens() * shape.top_k / std::max(1, shape.world_size());
  const int64_t mb = std::max(one_wave, std::min(two_waves, sched::round_up(routes_per_rank / 16, sched::kBlockM)));
  // With clusters a ticket holds two M tiles: an even tile count leaves no unit half empty.
  const int64_t unit = fwd_clusters ? 2 * sched::kBlockM : sched::kBlockM;
  return std::max<int64_t>(unit, std::min(sched::round_up(mb, unit), sched::round_up(shape.worst_case_rows(), unit)));
}

int64_t Config::resolved_macrobatch(const LayerShape& shape, int sm_count) const {
  const int64_t mb = resolved_minibatch(shape, sm_count);
  if (macrobatch_tokens > 0) return macrobatch_tokens;
  const int64_t budget = workspace_budget_bytes < 0 ? default_workspace_budget(shape, *this) : workspace_budget_bytes;
  if (budget > 0 && share_workspace && forward_path == ForwardPath::Megakernel) {
    // (validate() names the other uses.) The ring whose workspace fits on every rank (the ranks
    // compare the resolved ring when a layer is built).
    int64_t ring = 0;
    if (workspace_budget_bytes < 0) {
      // Automatic: where even two minibatches exceed the budget, the smallest ring.
      try {
        ring = ring_for_workspace(shape, *this, -1, sm_count, budget);
      } catch (const Error&) {
        ring = 2 * mb;
      }
    } else {
      ring = ring_for_workspace(shape, *this, -1, sm_count, budget);
    }
    if (ring > 0) return ring;  // else the worst case is within two minibatches: below
  }
  const int64_t widest = std::max({shape.hidden, 2 * shape.intermediate});
  const int64_t limit = (kInt32Max / widest) / mb * mb;  // largest ring that keeps 32-bit offsets
  return std::max(mb, std::min(sched::round_up(shape.worst_case_rows(), mb), limit));
}

int64_t Config::resolved_saved_rows(const LayerShape& shape) const {
  const int64_t cap = shape.worst_case_rows(), row_bytes = 4 * shape.intermediate;
  int64_t rows = 0;
  if (activation_budget_bytes >= 0) {
    rows = activation_budget_bytes / std::max<int64_t>(1, row_bytes) / sched::kBlockM * sched::kBlockM;
  } else {
    // What uniform routing lands on a rank (the routes of all ranks over W), an eighth more for
    // its fluctuation, and every local expert's padding to whole tiles.
    const int64_t uniform = sched::ceil_div(shape.total_tokens() * shape.top_k, std::max(1, shape.world_size()));
    rows = sched::round_up(uniform + uniform / 8 + shape.local_experts() * (sched::kBlockM - 1), sched::kBlockM);
  }
  return std::min(rows, cap);
}

void Config::validate(const LayerShape& shape, int sm_count) const {
  shape.validate();
  MOK_REQUIRE(fwd_comm_sms >= 0, "config.fwd_comm_sms", "must be >= 1 (or 0 = from the shape), got ",
              fwd_comm_sms);
  MOK_REQUIRE(!fwd_clusters || resolved_fwd_comm_sms(shape) % 2 == 0, "config.fwd_comm_sms",
              "must be even with config.fwd_clusters (SMs pair up into 2-CTA clusters), got ",
              resolved_fwd_comm_sms(shape));
  MOK_REQUIRE(bwd_comm_sms >= 1, "config.bwd_comm_sms", "must be >= 1, got ", bwd_comm_sms);
  if (sm_count > 0) {
    MOK_REQUIRE(resolved_fwd_comm_sms(shape) < sm_count, "config.fwd_comm_sms",
                "must leave at least one compute SM (SMs on this device = ", sm_count, ", got ",
                resolved_fwd_comm_sms(shape), ")");
    MOK_REQUIRE(bwd_comm_sms < sm_count, "config.bwd_comm_sms",
                "must leave at least one compute SM (SMs on this device = ", sm_count, ", got ",
                bwd_comm_sms, ")");
  }
  MOK_REQUIRE(minibatch_tokens >= 0 && minibatch_tokens % sched::kBlockM == 0,
              "config.minibatch_tokens", "must be 0 (automatic) or a positive multiple of ",
              sched::kBlockM, ", got ", minibatch_tokens);
  // With the SM count the layer runs with (the minibatch depends on it).
  const int64_t mb = resolved_minibatch(shape, sm_count);
  MOK_REQUIRE(macrobatch_tokens >= 0 && macrobatch_tokens % mb == 0, "config.macrobatch_tokens",
              "must be 0 (automatic) or a positive multiple of the minibatch (", mb, "), got ",
              macrobatch_tokens);
  MOK_REQUIRE(workspace_budget_bytes >= -1, "config.workspace_budget_bytes",
              "must be -1 (automatic), 0 (off) or a positive byte count, got ", workspace_budget_bytes);
  if (workspace_budget_bytes > 0) {
    MOK_REQUIRE(forward_path == ForwardPath::Megakernel, "config.workspace_budget_bytes",
                "sizes the megakernel's ring: needs forward_path megakernel");
    MOK_REQUIRE(share_workspace, "config.workspace_budget_bytes",
                "is the shared workspace's budget: needs config.share_workspace");
    MOK_REQUIRE(macrobatch_tokens == 0, "config.workspace_budget_bytes",
                "chooses the ring: leave config.macrobatch_tokens 0 (got ", macrobatch_tokens, ")");
  }
  const int64_t widest = std::max({shape.hidden, 2 * shape.intermediate});
  MOK_REQUIRE(fits_int32(resolved_macrobatch(shape, sm_count), widest), "config.macrobatch_tokens",
              "the ring buffer rows * max(H, 2I) = ", resolved_macrobatch(shape, sm_count), "*", widest,
              " must fit 32-bit indexing (< 2^31)");
  // FP8 trains on the unfused path and on the megakernel whose ring is below the worst case (its
  // backward over windows); the megakernel with a resident ring is forward only in FP8.
  const bool fp8_trains = forward_path == ForwardPath::Unfused ||
                          resolved_macrobatch(shape, sm_count) < shape.worst_case_rows();
  MOK_REQUIRE(!fp8_keep_weight_codes_t || (precision != Precision::BF16 && fp8_trains),
              "config.fp8_keep_weight_codes_t",
              "keeps the FP8 backward's weight codes: needs config.precision fp8 or mxfp8 and a path that trains in "
              "FP8 (forward_path unfused, or the megakernel with a ring below the worst case), got ",
              to_string(precision), ", ", to_string(forward_path));
  MOK_REQUIRE(saved_forwards >= 1 && saved_forwards <= 64, "config.saved_forwards", "must be in [1, 64], got ",
              saved_forwards);
  MOK_REQUIRE(saved_forwards == 1 || precision == Precision::BF16, "config.saved_forwards",
              "must be 1 with config.precision ", to_string(precision), " (the FP8 backward keeps one forward's state so far), got ",
              saved_forwards);
  MOK_REQUIRE(saved_forwards == 1 || (forward_path == ForwardPath::Megakernel && dispatch == DispatchPath::Pull),
              "config.saved_forwards", "more than 1 needs forward_path megakernel with dispatch pull, got ",
              saved_forwards);
  MOK_REQUIRE(activation_budget_bytes >= -1, "config.activation_budget_bytes",
              "must be -1 (automatic), 0 (full recompute) or a positive byte count, got ", activation_budget_bytes);
  MOK_REQUIRE(wait_timeout_s > 0.0 && wait_timeout_s <= 3600.0, "config.wait_timeout_s",
              "must be in (0, 3600] seconds, got ", wait_timeout_s);
  MOK_REQUIRE(cpu_threads >= 0, "config.cpu_threads", "must be >= 0 (0 = all cores), got ",
              cpu_threads);
  // FP8 (recipe 1) and MXFP8 (recipe 2) exist in the CPU reference's forward and backward (the
  // spec the GPU kernels match); the GPU layer runs both forward on both paths and trains on the
  // unfused one (layer_fp8_backward.cu), and refuses the rest by name (Layer's constructor,
  // layer_fp8.cu).
}

}  // namespace mok
