// GPU schedule builder. Four kernels, all index math from schedule_math.h:
//   1. count:   per chunk of kChunk slots of one source rank, routes per local expert
//               (shared-memory histogram; the chunk's row of chunk_hist, no global atomics);
//   2. scan:    per local expert, exclusive scan of chunk_hist over each rank's chunks (in place:
//               entries become the chunk's first ordinal) and the total per (expert, rank);
//   3. offsets: padded segment sizes, their prefix sum, totals, tile -> expert, padding rows;
//   4. place:   per chunk, the stable (slot-order) ordinal of each route within its
//               (expert, source rank), then its interleaved row.
// Integer atomics appear only in shared-memory histograms, whose sums are order-independent,
// so the table is deterministic and equals the CPU twin's bit for bit.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "common/error_word.h"
#include "mok/errors.hpp"
#include "schedule/schedule_gpu.h"
#include "schedule/schedule_math.h"

namespace mok::gpu {

namespace {

constexpr int kChunk = sched::kBuilderChunk;  // slots per count/place block
constexpr int kPlaceThreads = 1024; // place kernel: two sub-rounds of 1024 slots
constexpr int kScanThreads = 1024;

struct Params {
  const int32_t* const* tables;
  const uint32_t* abort;    // the communicator's abort word (may be null)
  uint32_t* aborted;        // this build's copy of it: count and place agree on one value
  int32_t routes[sched::kMaxWorldSize];           // T_r * k
  int32_t chunk_first[sched::kMaxWorldSize + 1];  // first chunk of each rank
  int world, rank, e_loc, first_expert, minibatch_rows, macrobatch_rows, capacity_tiles;
  int32_t* chunk_hist;
  int32_t* counts;
  int32_t* expert_rows;
  int32_t* expert_offset;
  int32_t* src_rank;
  int32_t* src_slot;
  int32_t* tile_expert;
  ScheduleTotals* totals;
};

__device__ __forceinline__ int rank_of_chunk(const Params& p, int chunk) {
  int r = 0;
  while (r + 1 < p.world && p.chunk_first[r + 1] <= chunk) ++r;
  return r;
}

// Exclusive scan over the block; `total` receives the block sum. All threads must call it.
template <int kThreads>
__device__ __forceinline__ int block_exclusive_scan(int v, int& total) {
  __shared__ int warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += n;
    }
    if (lane < kThreads / 32) warp_sums[lane] = w;  // inclusive warp prefix
  }
  __syncthreads();
  const int before = warp == 0 ? 0 : warp_sums[warp - 1];
  total = warp_sums[kThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + incl - v;
}

__global__ void __launch_bounds__(512) count_kernel(Params p) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < p.e_loc; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int chunk = blockIdx.x, r = rank_of_chunk(p, chunk);
  const int begin = (chunk - p.chunk_first[r]) * kChunk;
  // After a failure the peers' tables are not read: every count stays 0, the place kernel (which
  // reads the same snapshot) places nothing, and every consumer sees an empty schedule.
  const int end = *p.aborted != 0u ? begin : min(begin + kChunk, p.routes[r]);
  const int32_t* tab = p.tables[r];
  for (int s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const int le = tab[s] - p.first_expert;  // -1 slots land far below 0
    if (le >= 0 && le < p.e_loc) atomicAdd(&hist[le], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.e_loc; e += blockDim.x)
    p.chunk_hist[static_cast<int64_t>(chunk) * p.e_loc + e] = hist[e];
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(Params p) {
  const int e = blockIdx.x;
  for (int r = 0; r < p.world; ++r) {
    int carry = 0;
    for (int c0 = p.chunk_first[r]; c0 < p.chunk_first[r + 1]; c0 += kScanThreads) {
      const int c = c0 + threadIdx.x;
      const bool in = c < p.chunk_first[r + 1];
      int32_t* slot = &p.chunk_hist[static_cast<int64_t>(in ? c : 0) * p.e_loc + e];
      const int v = in ? *slot : 0;
      int total;
      const int excl = block_exclusive_scan<kScanThreads>(v, total);
      if (in) *slot = carry + excl;
      carry += total;
    }
    if (threadIdx.x == 0) p.counts[e * p.world + r] = carry;
  }
}

__global__ void __launch_bounds__(kScanThreads) offsets_kernel(Params p) {
  // A thread per expert scans the padded sizes; then each warp writes its experts' padding rows
  // and tile owners with its lanes along the rows. (One thread writing its own expert's padding,
  // up to 127 rows one after another, made every store instruction of a warp touch 32 lines: 19.5
  // us of a 0.75 ms Qwen3-30B-A3B T 2048 forward on one H100, the build's longest kernel.)
  __shared__ int32_t seg_begin[kScanThreads], pad_begin[kScanThreads], seg_end[kScanThreads];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int carry = 0;
  for (int e0 = 0; e0 < p.e_loc; e0 += kScanThreads) {
    const int e = e0 + threadIdx.x;
    int rows = 0;
    if (e < p.e_loc)
      for (int r = 0; r < p.world; ++r) rows += p.counts[e * p.world + r];
    const int padded = static_cast<int>(sched::pad_rows(rows));
    int total;
    const int excl = block_exclusive_scan<kScanThreads>(padded, total);
    if (e < p.e_loc) {
      const int off = carry + excl;
      p.expert_rows[e] = rows;
      p.expert_offset[e] = off;
    }
    seg_begin[threadIdx.x] = carry + excl;
    pad_begin[threadIdx.x] = carry + excl + rows;
    seg_end[threadIdx.x] = carry + excl + padded;
    __syncthreads();
    const int in_chunk = min(kScanThreads, p.e_loc - e0);
    for (int i = warp; i < in_chunk; i += kScanThreads / 32) {
      const int end = seg_end[i];
      for (int row = pad_begin[i] + lane; row < end; row += 32) {
        p.src_rank[row] = -1;
        p.src_slot[row] = -1;
      }
      for (int t = seg_begin[i] / sched::kBlockM + lane; t < end / sched::kBlockM; t += 32) p.tile_expert[t] = e0 + i;
    }
    __syncthreads();  // the segment arrays are the next chunk's
    carry += total;
  }
  // Tiles past the end belong to no expert: GEMMs sized for the worst case skip them.
  for (int t = carry / sched::kBlockM + threadIdx.x; t < p.capacity_tiles; t += blockDim.x)
    p.tile_expert[t] = -1;
  if (threadIdx.x == 0) {
    p.expert_offset[p.e_loc] = carry;
    ScheduleTotals t;
    t.total_rows = carry;
    t.total_tiles = carry / sched::kBlockM;
    t.num_minibatches = static_cast<int32_t>(sched::num_chunks(carry, p.minibatch_rows));
    t.num_macrobatches = static_cast<int32_t>(sched::num_chunks(carry, p.macrobatch_rows));
    *p.totals = t;
  }
}

// One value of the abort word for the whole build (it may change while the kernels run).
__global__ void snapshot_abort_kernel(Params p) {
  uint32_t v = 0;
  if (p.abort != nullptr) asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p.abort) : "memory");
  *p.aborted = v;
}

__global__ void __launch_bounds__(kPlaceThreads) place_kernel(Params p) {
  if (*p.aborted != 0u) return;  // nothing was counted
  // Shared: running ordinal per expert, per-warp counts of the current sub-round (rows of E_loc + 1
  // words, so that a warp reading one expert's 32 counts hits 32 banks), segment offsets, and the
  // (expert, rank) counts the interleave needs.
  extern __shared__ int32_t sm[];
  const int stride = p.e_loc + 1;
  int32_t* run = sm;                                  // [E_loc]
  int32_t* warp_cnt = run + p.e_loc;                  // [32, E_loc + 1]
  int32_t* offset = warp_cnt + 32 * stride;           // [E_loc]
  int32_t* counts = offset + p.e_loc;                 // [E_loc, W]
  const int chunk = blockIdx.x, r = rank_of_chunk(p, chunk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int begin = (chunk - p.chunk_first[r]) * kChunk;
  const int end = min(begin + kChunk, p.routes[r]);
  const int32_t* tab = p.tables[r];
  constexpr int kSubs = kChunk / kPlaceThreads;
  int expert_of[kSubs];  // every sub-round's table entry loaded at once, before the prologue's loads
#pragma unroll
  for (int sub = 0; sub < kSubs; ++sub) {
    const int s = begin + sub * kPlaceThreads + threadIdx.x;
    expert_of[sub] = s < end ? tab[s] - p.first_expert : -1;
  }
  for (int e = threadIdx.x; e < p.e_loc; e += blockDim.x) {
    run[e] = p.chunk_hist[static_cast<int64_t>(chunk) * p.e_loc + e];
    offset[e] = p.expert_offset[e];
  }
  for (int i = threadIdx.x; i < p.e_loc * p.world; i += blockDim.x) counts[i] = p.counts[i];
#pragma unroll
  for (int sub = 0; sub < kSubs; ++sub) {
    for (int i = threadIdx.x; i < 32 * stride; i += blockDim.x) warp_cnt[i] = 0;
    __syncthreads();
    const int s = begin + sub * kPlaceThreads + threadIdx.x;
    int le = expert_of[sub];
    const bool mine = le >= 0 && le < p.e_loc;
    if (!mine) le = -1;
    const unsigned same = __match_any_sync(0xffffffffu, le);
    const int lane_rank = __popc(same & lanes_below);
    if (mine && lane_rank == 0) warp_cnt[warp * stride + le] = __popc(same);
    __syncthreads();
    // Per expert, a warp scans the 32 warps' counts (lane = warp): each count becomes that warp's
    // first ordinal, and the running ordinal moves past the sub-round. (Slot order, as before.)
    for (int e = warp; e < p.e_loc; e += kPlaceThreads / 32) {
      const int c = warp_cnt[lane * stride + e];
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += n;
      }
      const int base = run[e];
      warp_cnt[lane * stride + e] = base + incl - c;
      __syncwarp();
      if (lane == 31) run[e] = base + incl;
    }
    __syncthreads();
    if (mine) {
      const int ordinal = warp_cnt[warp * stride + le] + lane_rank;
      const int64_t row =
          offset[le] + sched::interleaved_row(&counts[le * p.world], p.world, r, ordinal);
      p.src_rank[row] = r;
      p.src_slot[row] = s;
    }
    __syncthreads();  // warp_cnt is the next sub-round's
  }
}

// The validity of one routing slot: an expert id in [-1, E), and for a routed slot a finite,
// non-negative router weight. An invalid slot becomes an empty one (-1) everywhere.
template <typename Idx>
__device__ __forceinline__ int32_t checked_slot(const Idx* in, const float* w, int64_t i, int64_t experts, int rank,
                                                unsigned long long* error_word) {
  const Idx id = in[i];
  if (!(id >= -1 && id < static_cast<Idx>(experts))) {
    report_device_error(error_word, DeviceErrorCode::InvalidExpertId, rank, static_cast<uint64_t>(i));
    return -1;
  }
  if (id >= 0 && w != nullptr) {
    const float v = w[i];
    if (!(isfinite(v) && v >= 0.0f)) {  // NaN fails both tests
      report_device_error(error_word, DeviceErrorCode::InvalidRouterWeight, rank, static_cast<uint64_t>(i));
      return -1;
    }
  }
  return static_cast<int32_t>(id);
}

template <typename Idx>
__global__ void publish_kernel(const Idx* __restrict__ in, const float* __restrict__ w, int64_t n, int64_t experts,
                               int rank, int32_t* __restrict__ out, unsigned long long* error_word) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = checked_slot(in, w, i, experts, rank, error_word);
}

template <typename Idx>
__global__ void backward_routing_kernel(const Idx* __restrict__ in, const float* __restrict__ w, int64_t n,
                                        int64_t experts, int rank, const int32_t* __restrict__ published,
                                        float* __restrict__ w_out, unsigned long long* error_word) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t id = checked_slot(in, w, i, experts, rank, error_word);
  const int32_t fwd = published[i];
  if (id != fwd) report_device_error(error_word, DeviceErrorCode::RoutingChanged, rank, static_cast<uint64_t>(i));
  // The forward's slots, with the weight checked now: a bad one (id -1 from checked_slot) reaches
  // no peer's reverse combine.
  w_out[i] = fwd >= 0 && id >= 0 ? w[i] : 0.0f;
}

size_t place_smem_bytes(int e_loc, int world) {
  return sizeof(int32_t) * (static_cast<size_t>(e_loc) * (34 + world) + 32);
}

template <typename T>
T* device_alloc(int64_t n, const char* what) {
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaSuccess) err = cudaMemset(p, 0, bytes);  // never read before written, but initcheck-clean
  if (err != cudaSuccess)
    throw Error(ErrorKind::Runtime, what, cudaGetErrorString(err), "schedule buffer allocation");
  return static_cast<T*>(p);
}

}  // namespace

void publish_routing(const void* topk_idx, bool is_int64, const float* topk_w, int64_t tokens, int64_t top_k,
                     int64_t experts, int rank, int32_t* published, unsigned long long* error_word,
                     cudaStream_t stream) {
  const int64_t n = tokens * top_k;
  if (n == 0) return;
  MOK_REQUIRE(topk_idx && published, "topk_idx", "input and published buffers must be non-null");
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((n + threads - 1) / threads);
  if (is_int64)
    publish_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx), topk_w, n, experts, rank,
                                                   published, error_word);
  else
    publish_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx), topk_w, n, experts, rank,
                                                   published, error_word);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void check_backward_routing(const void* topk_idx, bool is_int64, const float* topk_w, int64_t tokens,
                            int64_t top_k, int64_t experts, int rank, const int32_t* published, float* weights,
                            unsigned long long* error_word, cudaStream_t stream) {
  const int64_t n = tokens * top_k;
  if (n == 0) return;
  MOK_REQUIRE(topk_idx && topk_w && published && weights, "topk_idx", "input and output buffers must be non-null");
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((n + threads - 1) / threads);
  if (is_int64)
    backward_routing_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx), topk_w, n, experts,
                                                            rank, published, weights, error_word);
  else
    backward_routing_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx), topk_w, n, experts,
                                                            rank, published, weights, error_word);
  MOK_CUDA_CHECK(cudaGetLastError());
}

ScheduleBuilder::ScheduleBuilder(const LayerShape& shape, const Config& config, int rank,
                                 const int32_t* const* tables, int sm_count)
    : shape_(shape), rank_(rank), tables_(tables) {
  config.validate(shape, sm_count);
  MOK_REQUIRE(rank >= 0 && rank < shape.world_size(), "rank", "must be in [0, W) (W = ",
              shape.world_size(), "), got ", rank);
  MOK_REQUIRE(tables != nullptr, "tables", "the device array of published routing tables is null");
  minibatch_rows_ = config.resolved_minibatch(shape, sm_count);
  macrobatch_rows_ = config.resolved_macrobatch(shape, sm_count);
  capacity_rows_ = shape.worst_case_rows();
  total_chunks_ = 0;
  for (int r = 0; r < shape.world_size(); ++r)
    total_chunks_ += sched::ceil_div(shape.tokens_of(r) * shape.top_k, kChunk);
  const int64_t e_loc = shape.local_experts();
  MOK_REQUIRE(place_smem_bytes(static_cast<int>(e_loc), shape.world_size()) <= 200 * 1024,
              "shape.experts", "local experts times (34 + W) int32 (+ 32) must fit in shared memory (E_loc = ",
              e_loc, ")");
  const sched::BuilderSizes n = sched::builder_sizes(total_chunks_, e_loc, shape.world_size(), capacity_rows_);
  chunk_hist_ = device_alloc<int32_t>(n.chunk_hist, "chunk_hist");
  counts_ = device_alloc<int32_t>(n.counts, "counts");
  expert_rows_ = device_alloc<int32_t>(n.expert_rows, "expert_rows");
  expert_offset_ = device_alloc<int32_t>(n.expert_offset, "expert_offset");
  src_rank_ = device_alloc<int32_t>(n.src_rank, "src_rank");
  src_slot_ = device_alloc<int32_t>(n.src_slot, "src_slot");
  tile_expert_ = device_alloc<int32_t>(n.tile_expert, "tile_expert");
  totals_ = device_alloc<ScheduleTotals>(1, "totals");
  aborted_ = device_alloc<uint32_t>(1, "abort snapshot");
  MOK_CUDA_CHECK(cudaFuncSetAttribute(place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(place_smem_bytes(static_cast<int>(e_loc), shape.world_size()))));
}

ScheduleBuilder::~ScheduleBuilder() {
  for (void* p : {static_cast<void*>(chunk_hist_), static_cast<void*>(counts_),
                  static_cast<void*>(expert_rows_), static_cast<void*>(expert_offset_),
                  static_cast<void*>(src_rank_), static_cast<void*>(src_slot_),
                  static_cast<void*>(tile_expert_), static_cast<void*>(totals_), static_cast<void*>(aborted_)})
    if (p) cudaFree(p);
}

void ScheduleBuilder::build(cudaStream_t stream, const uint32_t* abort) {
  Params p{};
  p.tables = tables_;
  p.abort = abort;
  p.aborted = aborted_;
  p.world = shape_.world_size();
  p.rank = rank_;
  p.e_loc = static_cast<int>(shape_.local_experts());
  p.first_expert = static_cast<int>(rank_ * shape_.local_experts());
  p.minibatch_rows = static_cast<int>(minibatch_rows_);
  p.macrobatch_rows = static_cast<int>(macrobatch_rows_);
  p.capacity_tiles = static_cast<int>(capacity_rows_ / sched::kBlockM);
  int32_t chunk = 0;
  for (int r = 0; r < p.world; ++r) {
    p.routes[r] = static_cast<int32_t>(shape_.tokens_of(r) * shape_.top_k);
    p.chunk_first[r] = chunk;
    chunk += static_cast<int32_t>(sched::ceil_div(p.routes[r], kChunk));
  }
  p.chunk_first[p.world] = chunk;
  p.chunk_hist = chunk_hist_;
  p.counts = counts_;
  p.expert_rows = expert_rows_;
  p.expert_offset = expert_offset_;
  p.src_rank = src_rank_;
  p.src_slot = src_slot_;
  p.tile_expert = tile_expert_;
  p.totals = totals_;
  const auto chunks = static_cast<unsigned>(total_chunks_);
  const size_t hist_bytes = sizeof(int32_t) * static_cast<size_t>(p.e_loc);
  snapshot_abort_kernel<<<1, 1, 0, stream>>>(p);
  if (chunks > 0) count_kernel<<<chunks, 512, hist_bytes, stream>>>(p);
  scan_kernel<<<static_cast<unsigned>(p.e_loc), kScanThreads, 0, stream>>>(p);
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(p);
  if (chunks > 0)
    place_kernel<<<chunks, kPlaceThreads, place_smem_bytes(p.e_loc, p.world), stream>>>(p);
  MOK_CUDA_CHECK(cudaGetLastError());
}

ScheduleView ScheduleBuilder::view() const {
  return {counts_, expert_rows_, expert_offset_, src_rank_, src_slot_, tile_expert_, totals_, capacity_rows_};
}

}  // namespace mok::gpu
