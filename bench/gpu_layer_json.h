// mok_bench's GPU mode: the JSON fields a case adds next to its times (tiles, NVLink traffic,
// memory per layer) and small text helpers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/config.hpp"
#include "mok/workload.hpp"

namespace mok::bench {

// Each rank's M tiles (the CPU twin of the schedule on the same routing) as JSON fields: tiles,
// those with 1..32 and 33..64 token rows, and the MMA work over the token rows' (split-N on).
std::string tile_stats_json(const LayerShape& shape, const Workload& wl);

// Rows each rank receives over NVLink in one forward: its peers' token rows routed to its experts
// (pulled into its ring) and its own tokens' rows computed by peers (combined into its slots).
// Every such row also leaves one rank, so each rank sends as many rows as it receives. Empty
// slots (-1) move nothing.
std::vector<int64_t> nvlink_rows_per_rank(const LayerShape& shape, const Workload& wl);

// A case's NVLink traffic per direction: the busiest rank's bytes and their rate over the forward
// (the slowest rank's time). Printed after the main variant and written as JSON fields, with the
// bytes of every rank and the share of the copy ceiling.
struct LinkRate {
  int64_t most_bytes = 0;
  double gbps = 0;
};
LinkRate link_rate(const std::vector<int64_t>& rows, int64_t H, double ms);
std::string nvlink_json(const std::vector<int64_t>& rows, int64_t H, const LinkRate& l, double ceiling);

// The layer's planned device memory on rank 0 (include/mok/memory.hpp; the layer allocates these
// sizes), next to the times: "memory": {total, layer, saved, backward, symmetric} in bytes, and
// what rank 0's device lost to the layer: at construction ("measured_built_bytes") and, when the
// backward ran, with its first backward ("measured_bytes" = both; omitted when it did not run).
// "windows_from_pool": the layer's symmetric windows were ones an earlier case's layer gave back
// to the communicator's pool, so the measurement does not hold them (compare with the plan's
// total less symmetric_bytes then).
std::string memory_json(const LayerShape& shape, const Config& cfg, int64_t built, int64_t first_backward,
                        bool windows_from_pool);

std::string seconds_text(double s);

}  // namespace mok::bench
