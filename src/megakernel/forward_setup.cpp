#include "megakernel/forward_setup.h"

#include <algorithm>

#include "mok/errors.hpp"
#include "schedule/schedule_math.h"

namespace mok::mk {

ForwardSetup plan_forward(const LayerShape& shape, const Config& config, int rank, int sm_count) {
  config.validate(shape, sm_count);
  ForwardSetup s;
  s.sm_count = sm_count;
  s.cap_rows = shape.worst_case_rows();
  s.cluster = config.fwd_clusters;
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const int64_t T = shape.tokens_of(rank);
  const int64_t mb = config.resolved_minibatch(shape, sm_count), ring = config.resolved_macrobatch(shape, sm_count);
  MOK_REQUIRE(ring >= s.cap_rows || ring >= 2 * mb, "config.macrobatch_tokens",
              "the megakernel's ring must hold at least two minibatches (2 x ", mb,
              " rows) when it is smaller than the worst case (", s.cap_rows, " rows), got ", ring);
  MOK_REQUIRE(ring % mb == 0, "config.macrobatch_tokens", "must be a multiple of the minibatch (", mb,
              " rows with ", sm_count > 0 ? sm_count : 132, " SMs), got ", ring);
  MOK_REQUIRE(Is == 0 || Is % 64 == 0, "shape.shared_intermediate", "must be a multiple of 64, got ", Is);
  // Never more than can be used; at least one tile (valid tensor maps without any tokens).
  s.ring_rows = std::max<int64_t>(sched::kBlockM, std::min(ring, sched::round_up(s.cap_rows, mb)));
  s.windowed = s.ring_rows < s.cap_rows;
  s.saved_rows = s.windowed ? config.resolved_saved_rows(shape) : 0;
  MOK_REQUIRE(config.saved_forwards == 1 || s.windowed, "config.saved_forwards",
              "more than 1 needs a ring below the worst case (config.macrobatch_tokens < ", s.cap_rows,
              " rows: the backward over windows), got ", config.saved_forwards, " with a ring of ", s.ring_rows);
  PlanShape& p = s.plan;
  p.mb_rows = static_cast<int32_t>(mb);
  p.ring_rows = static_cast<int32_t>(s.ring_rows);
  p.n1 = static_cast<int32_t>(sched::ceil_div(2 * I, kForwardBlockN));
  p.n2 = static_cast<int32_t>(sched::ceil_div(H, kForwardBlockN));
  p.s_tiles = Is > 0 && T > 0 ? static_cast<int32_t>(sched::ceil_div(T, sched::kBlockM)) : 0;
  p.n1s = static_cast<int32_t>(sched::ceil_div(2 * Is, kForwardBlockN));
  p.n2s = p.n2;
  p.comm_ctas = config.resolved_fwd_comm_sms(shape);
  p.pair = s.cluster ? 1 : 0;
  p.group_m = s.cluster ? 4 : 8;  // raster groups of 8 M tiles (as the grouped GEMM)
  s.layout.max_positions = static_cast<int32_t>(sched::ceil_div(s.cap_rows, mb));
  s.layout.max_tiles = static_cast<int32_t>(s.cap_rows / sched::kBlockM);
  s.layout.s_tiles = p.s_tiles;
  MOK_REQUIRE(num_tickets(p, s.layout.max_positions) < (int64_t(1) << 31), "shape",
              "the megakernel's task tickets (", num_tickets(p, s.layout.max_positions), ") must fit 31 bits");
  s.widest = s.layout;
  s.widest.s_tiles = Is > 0 ? static_cast<int32_t>(sched::ceil_div(shape.max_tokens(), sched::kBlockM)) : 0;
  return s;
}

}  // namespace mok::mk
