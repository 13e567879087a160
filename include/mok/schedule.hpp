// mok — the receiver-side routing schedule of one EP rank (host form).
//
// Row i of a rank's routed buffer holds the token of (src_rank[i], src_slot[i]), where
// src_slot = t*k + j on the source rank; padding rows hold -1. The index math is in
// src/schedule/schedule_math.h; this host form is what the CPU reference executes and what the GPU
// builder's output is checked against, bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/config.hpp"

namespace mok {

struct ScheduleTable {
  int rank = 0;
  int world = 1;
  int64_t local_experts = 0;
  int64_t total_rows = 0;              // padded rows in use (multiple of 128)
  std::vector<int32_t> counts;         // [E_loc, W] routes from source rank w to local expert e
  std::vector<int32_t> expert_rows;    // [E_loc] valid rows per local expert
  std::vector<int32_t> expert_offset;  // [E_loc + 1] first padded row of each expert segment
  std::vector<int32_t> src_rank;       // [total_rows] source rank, -1 = padding
  std::vector<int32_t> src_slot;       // [total_rows] source slot t*k + j, -1 = padding
  std::vector<int32_t> tile_expert;    // [total_rows / 128] local expert of each M-tile

  int64_t num_tiles() const { return static_cast<int64_t>(tile_expert.size()); }
};

// The 128-row M tiles of a table and how many of them hold few tokens, which the GEMM engine runs
// in partial forms: tiles of 33..64 token rows in split-N form (half a tile's MMAs), tiles of
// 1..32 rows in split-N or, where enabled, swap-AB form (a quarter). A measure of the padding the
// schedule's 128-row granularity costs.
struct TileStats {
  int64_t rows = 0;         // token rows
  int64_t tiles = 0;        // M tiles (token rows padded per expert to a multiple of 128)
  int64_t tiles_le32 = 0;   // tiles with 1..32 token rows
  int64_t tiles_le64 = 0;   // tiles with 33..64 token rows
  // MMA work of the tiles over that of the token rows alone (rows / 128 tiles): 1 = no padding.
  double mma_over_useful(bool swap_ab) const {
    if (rows == 0) return 1.0;
    const double small = static_cast<double>(tiles_le32), mid = static_cast<double>(tiles_le64);
    const double work = static_cast<double>(tiles) - small - mid + 0.5 * mid + (swap_ab ? 0.25 : 0.5) * small;
    return work * 128.0 / static_cast<double>(rows);
  }
};
TileStats tile_stats(const ScheduleTable& s);

// Builds rank `rank`'s table from every rank's topk_idx ([T_r, k], global ids, -1 = empty), the
// CPU twin of the GPU schedule kernels. The ids must already be validated.
ScheduleTable build_schedule_cpu(const LayerShape& shape, int rank,
                                 const std::vector<std::span<const int32_t>>& topk_idx);

}  // namespace mok
