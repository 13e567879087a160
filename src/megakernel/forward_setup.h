// mok — the forward megakernel's host plan: every knob of one rank's forward resolved once, with
// the device's real SM count (H100 PCIe has 114 SMs, H100/H200 SXM 132), into what the kernel and
// the layer's buffers need. Pure host code, no GPU: the CPU tests check it, and the layer
// (src/megakernel/layer.cu) only allocates and launches what it says.
#pragma once

#include <cstdint>

#include "megakernel/forward_plan.h"
#include "mok/config.hpp"

namespace mok::mk {

// BLOCK_N of the forward's tiles (the engine's Cfg<256>; forward_kernel.cu checks they agree).
inline constexpr int64_t kForwardBlockN = 256;
// The task ring of a compute CTA, and (2-CTA clusters) the global task slots through which rank 0
// hands rank 1 its tasks: kForwardTaskSlots of kForwardTaskSlotBytes per cluster (blockIdx.x / 2).
inline constexpr int kForwardTaskSlots = 3;
inline constexpr int kForwardTaskSlotBytes = 64;
inline constexpr int64_t forward_cluster_slot_bytes(int grid) {
  return int64_t((grid + 1) / 2) * kForwardTaskSlots * kForwardTaskSlotBytes;
}

struct ForwardSetup {
  PlanShape plan;          // minibatch, ring, N tiles, comm CTAs, raster groups, pairs
  CounterLayout layout;    // this rank's counter block
  CounterLayout widest;    // the same sized for the largest T of any rank (push dispatch: every
                           // rank's block is one symmetric window of equal size)
  int64_t cap_rows = 0;    // worst-case routed rows of this rank (LayerShape::worst_case_rows)
  int64_t ring_rows = 0;   // R: rows of the x / h / y rings (plan.ring_rows)
  bool windowed = false;   // R < cap_rows: the backward runs over windows of the ring
  int64_t saved_rows = 0;  // windowed: gate/up rows a forward keeps (Config::resolved_saved_rows)
  bool cluster = false;    // 2-CTA clusters (Config::fwd_clusters)
  int sm_count = 0;        // the SM count the plan was made for
};

// Throws mok::Error naming the setting when the shape/config cannot run on the megakernel (a ring
// of fewer than two minibatches below the worst case, Is not a multiple of 64, tickets past 31
// bits). `sm_count` 0 = the default of the target parts (132).
ForwardSetup plan_forward(const LayerShape& shape, const Config& config, int rank, int sm_count);

}  // namespace mok::mk
