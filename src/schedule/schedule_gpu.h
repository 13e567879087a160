// mok — the routing schedule built on the GPU (no host synchronization, graph-capturable).
//
// Each rank first publishes its topk_idx as int32 (publish_routing: casts int64, checks every id
// against [-1, E) and reports bad ones through the device error word, replacing them with -1 so
// no kernel ever indexes out of range). After a barrier, every rank's ScheduleBuilder reads all
// ranks' published tables (through peer pointers over NVLink) and builds its receiver-side table
// with the index math of schedule_math.h — bitwise the table of the CPU twin
// (build_schedule_cpu). All buffers are sized once for the worst case, so build() allocates
// nothing and can be captured in a CUDA graph and replayed with new routing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/config.hpp"

namespace mok::gpu {

// Written by the builder for the megakernel (device memory).
struct ScheduleTotals {
  int32_t total_rows;        // padded routed rows (multiple of 128)
  int32_t total_tiles;       // total_rows / 128
  int32_t num_minibatches;   // ceil(total_rows / minibatch rows)
  int32_t num_macrobatches;  // ceil(total_rows / macrobatch rows)
};

// Device views of a built schedule.
struct ScheduleView {
  const int32_t* counts;         // [E_loc, W]
  const int32_t* expert_rows;    // [E_loc]
  const int32_t* expert_offset;  // [E_loc + 1]
  const int32_t* src_rank;       // [capacity] (valid up to total_rows)
  const int32_t* src_slot;       // [capacity]
  const int32_t* tile_expert;    // [capacity / 128], -1 past total_tiles
  const ScheduleTotals* totals;
  int64_t capacity_rows;
};

// Casts/validates one rank's topk_idx ([T, k], int32 or int64) into `published` ([T, k] int32).
// An invalid slot — an id outside [-1, E), or a routed slot whose topk_w (may be null: not
// checked) is NaN, infinite or negative — is reported to `error_word` (may be null; the first
// problem wins) and written as -1: an empty slot for every later kernel.
void publish_routing(const void* topk_idx, bool is_int64, const float* topk_w, int64_t tokens, int64_t top_k,
                     int64_t experts, int rank, int32_t* published, unsigned long long* error_word,
                     cudaStream_t stream);
// The backward's view of the same routing: checks topk_idx / topk_w again (so the backward
// reports a bad entry too), reports RoutingChanged where the checked id differs from the
// forward's `published` one, and writes weights[i] = topk_w[i] for the slots the forward routed
// and 0 for its empty ones (the backward uses the forward's slots throughout).
void check_backward_routing(const void* topk_idx, bool is_int64, const float* topk_w, int64_t tokens,
                            int64_t top_k, int64_t experts, int rank, const int32_t* published, float* weights,
                            unsigned long long* error_word, cudaStream_t stream);

class ScheduleBuilder {
 public:
  // Allocates every buffer for the worst case of `shape` (throws mok::Error). `tables` is a
  // device array of W pointers, entry r pointing at rank r's published [T_r, k] int32 table
  // (a peer address for r != rank); it must stay valid while the builder is used.
  // `sm_count`: the device's SMs for the minibatch rule (Config::resolved_minibatch; 0 = default):
  // the megakernel's plan must use the same.
  ScheduleBuilder(const LayerShape& shape, const Config& config, int rank,
                  const int32_t* const* tables, int sm_count = 0);
  ~ScheduleBuilder();
  ScheduleBuilder(const ScheduleBuilder&) = delete;
  ScheduleBuilder& operator=(const ScheduleBuilder&) = delete;

  // Enqueues the build on `stream`: 5 kernels, no host synchronization. `abort`
  // (the communicator's abort word, may be null): once nonzero, the peers' tables are not read
  // and the schedule is empty.
  void build(cudaStream_t stream, const uint32_t* abort = nullptr);
  ScheduleView view() const;

 private:
  LayerShape shape_;
  int rank_;
  int64_t minibatch_rows_, macrobatch_rows_, capacity_rows_, total_chunks_;
  const int32_t* const* tables_;
  int32_t* chunk_first_ = nullptr;  // [W + 1] first chunk of each rank
  int32_t* chunk_hist_ = nullptr;   // [total_chunks, E_loc] routes per chunk and local expert
  int32_t* counts_ = nullptr;
  int32_t* expert_rows_ = nullptr;
  int32_t* expert_offset_ = nullptr;
  int32_t* src_rank_ = nullptr;
  int32_t* src_slot_ = nullptr;
  int32_t* tile_expert_ = nullptr;
  ScheduleTotals* totals_ = nullptr;
  uint32_t* aborted_ = nullptr;  // the abort word as this build saw it
};

}  // namespace mok::gpu
