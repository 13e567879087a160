// CPU twin of the GPU schedule builder: same index math (schedule_math.h), same table.
#include <algorithm>

#include "mok/errors.hpp"
#include "mok/schedule.hpp"
#include "schedule/schedule_math.h"

namespace mok {

ScheduleTable build_schedule_cpu(const LayerShape& shape, int rank,
                                 const std::vector<std::span<const int32_t>>& topk_idx) {
  const int W = shape.world_size();
  const int64_t e_loc = shape.local_experts();
  const int64_t k = shape.top_k;
  MOK_REQUIRE(rank >= 0 && rank < W, "rank", "must be in [0, W) (W = ", W, "), got ", rank);
  MOK_REQUIRE(static_cast<int>(topk_idx.size()) == W, "topk_idx",
              "one routing table per rank is required (W = ", W, "), got ", topk_idx.size());

  ScheduleTable s;
  s.rank = rank;
  s.world = W;
  s.local_experts = e_loc;
  s.counts.assign(static_cast<size_t>(e_loc * W), 0);
  const int64_t first_expert = rank * e_loc;

  // 1. Counts per (local expert, source rank).
  for (int r = 0; r < W; ++r) {
    const auto& idx = topk_idx[static_cast<size_t>(r)];
    MOK_REQUIRE(static_cast<int64_t>(idx.size()) == shape.tokens_of(r) * k, "topk_idx",
                "rank ", r, " must have T*k = ", shape.tokens_of(r) * k, " entries, got ",
                idx.size());
    for (int32_t e : idx) {
      if (e < 0) continue;
      if (e >= first_expert && e < first_expert + e_loc) ++s.counts[static_cast<size_t>((e - first_expert) * W + r)];
    }
  }

  // 2. Padded segments.
  s.expert_rows.assign(static_cast<size_t>(e_loc), 0);
  s.expert_offset.assign(static_cast<size_t>(e_loc + 1), 0);
  for (int64_t e = 0; e < e_loc; ++e) {
    int64_t n = 0;
    for (int r = 0; r < W; ++r) n += s.counts[static_cast<size_t>(e * W + r)];
    s.expert_rows[static_cast<size_t>(e)] = static_cast<int32_t>(n);
    s.expert_offset[static_cast<size_t>(e + 1)] =
        static_cast<int32_t>(s.expert_offset[static_cast<size_t>(e)] + sched::pad_rows(n));
  }
  s.total_rows = s.expert_offset[static_cast<size_t>(e_loc)];
  s.src_rank.assign(static_cast<size_t>(s.total_rows), -1);
  s.src_slot.assign(static_cast<size_t>(s.total_rows), -1);
  s.tile_expert.assign(static_cast<size_t>(s.total_rows / sched::kBlockM), -1);
  for (int64_t e = 0; e < e_loc; ++e) {
    for (int64_t row = s.expert_offset[static_cast<size_t>(e)]; row < s.expert_offset[static_cast<size_t>(e + 1)]; row += sched::kBlockM)
      s.tile_expert[static_cast<size_t>(row / sched::kBlockM)] = static_cast<int32_t>(e);
  }

  // 3. Placement: the n-th route (slot order) of rank r to expert e.
  std::vector<int64_t> ordinal(static_cast<size_t>(e_loc), 0);
  for (int r = 0; r < W; ++r) {
    std::fill(ordinal.begin(), ordinal.end(), 0);
    const auto& idx = topk_idx[static_cast<size_t>(r)];
    for (size_t slot = 0; slot < idx.size(); ++slot) {
      const int32_t e = idx[slot];
      if (e < first_expert || e >= first_expert + e_loc) continue;
      const int64_t le = e - first_expert;
      const int64_t n = ordinal[static_cast<size_t>(le)]++;
      const int64_t row = s.expert_offset[static_cast<size_t>(le)] +
                          sched::interleaved_row(&s.counts[static_cast<size_t>(le * W)], W, r, n);
      s.src_rank[static_cast<size_t>(row)] = r;
      s.src_slot[static_cast<size_t>(row)] = static_cast<int32_t>(slot);
    }
  }
  return s;
}

TileStats tile_stats(const ScheduleTable& s) {
  TileStats t;
  for (const int32_t n : s.expert_rows) {
    t.rows += n;
    t.tiles += (n + 127) / 128;
    const int32_t tail = n % 128;
    t.tiles_le32 += tail >= 1 && tail <= 32;
    t.tiles_le64 += tail > 32 && tail <= 64;
  }
  return t;
}

}  // namespace mok
