// mok_bench's GPU mode: the JSON fields of a case (gpu_layer_json.h).
#include "gpu_layer_json.h"

#include <algorithm>
#include <cstdio>
#include <span>

#include "gpu_layer_variants.h"
#include "mok/memory.hpp"
#include "mok/schedule.hpp"

namespace mok::bench {

// Each rank's M tiles (the CPU twin of the schedule on the same routing) as JSON fields: tiles,
// those with 1..32 and 33..64 token rows, and the MMA work over the token rows' (split-N on).
std::string tile_stats_json(const LayerShape& shape, const Workload& wl) {
  std::vector<std::span<const int32_t>> idx;
  for (const auto& in : wl.inputs) idx.emplace_back(in.topk_idx);
  std::string tiles, le32, le64, over;
  for (int r = 0; r < shape.world_size(); ++r) {
    const TileStats t = tile_stats(build_schedule_cpu(shape, r, idx));
    const char* sep = r ? ", " : "";
    tiles += sep + std::to_string(t.tiles);
    le32 += sep + std::to_string(t.tiles_le32);
    le64 += sep + std::to_string(t.tiles_le64);
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.4f", sep, t.mma_over_useful(false));
    over += buf;
  }
  return ", \"tiles\": [" + tiles + "], \"tiles_1_32_rows\": [" + le32 + "], \"tiles_33_64_rows\": [" + le64 +
         "], \"tile_mma_over_token_rows\": [" + over + "]";
}

// Rows each rank receives over NVLink in one forward: its peers' token rows routed to its experts
// (pulled into its ring) and its own tokens' rows computed by peers (combined into its slots).
// Every such row also leaves one rank, so each rank sends as many rows as it receives. Empty
// slots (-1) move nothing.
std::vector<int64_t> nvlink_rows_per_rank(const LayerShape& shape, const Workload& wl) {
  const int W = shape.world_size();
  const int64_t e_loc = shape.local_experts();
  std::vector<int64_t> rows(static_cast<size_t>(W), 0);
  for (int s = 0; s < W; ++s) {
    for (const int32_t e : wl.inputs[static_cast<size_t>(s)].topk_idx) {
      if (e < 0) continue;
      const int owner = static_cast<int>(e / e_loc);
      if (owner == s) continue;
      ++rows[static_cast<size_t>(owner)];  // pulled by the owner
      ++rows[static_cast<size_t>(s)];      // combined back into s
    }
  }
  return rows;
}

// A case's NVLink traffic per direction: the busiest rank's bytes and their rate over the forward
// (the slowest rank's time). Printed after the main variant and written as JSON fields, with the
// bytes of every rank and the share of the copy ceiling.
LinkRate link_rate(const std::vector<int64_t>& rows, int64_t H, double ms) {
  LinkRate l;
  for (const int64_t r : rows) l.most_bytes = std::max(l.most_bytes, r * H * 2);
  l.gbps = ms > 0 ? static_cast<double>(l.most_bytes) / (ms * 1e-3) / 1e9 : 0.0;
  return l;
}
std::string nvlink_json(const std::vector<int64_t>& rows, int64_t H, const LinkRate& l, double ceiling) {
  std::string list;
  for (const int64_t r : rows) list += std::string(list.empty() ? "" : ", ") + std::to_string(r * H * 2);
  std::string out = ", \"nvlink_bytes_per_rank\": [" + list + "], \"mok_nvlink_GBps\": " + std::to_string(l.gbps);
  if (ceiling > 0) out += ", \"nvlink_fraction_of_ceiling\": " + std::to_string(l.gbps / ceiling);
  return out;
}


// The layer's planned device memory on rank 0 (include/mok/memory.hpp; the layer allocates these
// sizes), next to the times: "memory": {total, layer, saved, backward, symmetric} in bytes, and
// what rank 0's device lost to the layer: at construction ("measured_built_bytes") and, when the
// backward ran, with its first backward ("measured_bytes" = both; omitted when it did not run).
// "windows_from_pool": the layer's symmetric windows were ones an earlier case's layer gave back
// to the communicator's pool, so the measurement does not hold them (compare with the plan's
// total less symmetric_bytes then).
std::string memory_json(const LayerShape& shape, const Config& cfg, int64_t built, int64_t first_backward,
                        bool windows_from_pool) {
  const MemoryPlan p = plan_memory(shape, cfg, 0, device_sms());
  return ", \"memory\": {\"mode\": \"" + std::string(p.backward_mode()) + "\", \"share_workspace\": " +
         (cfg.share_workspace ? "true" : "false") + ", \"measured_built_bytes\": " +
         std::to_string(built) +
         ", \"windows_from_pool\": " + (windows_from_pool ? "true" : "false") +
         (first_backward >= 0 ? ", \"measured_bytes\": " + std::to_string(built + first_backward) : std::string()) +
         ", \"total_bytes\": " + std::to_string(p.total()) +
         ", \"layer_bytes\": " + std::to_string(p.total(MemoryScope::Layer) + p.total(MemoryScope::Saved)) +
         ", \"saved_bytes\": " + std::to_string(p.total(MemoryScope::Saved)) +
         ", \"backward_bytes\": " + std::to_string(p.total(MemoryScope::Backward)) +
         ", \"symmetric_bytes\": " + std::to_string(p.symmetric()) +
         ", \"workspace_bytes\": " + std::to_string(p.workspace()) + "}";
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace mok::bench
