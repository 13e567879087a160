// Row-copy kernels of the pull/push microbenchmark and the signalling ping-pong.
//
// A copy moves `rows` rows of `row_bytes` from src to dst; either side may be indexed (gather on the
// source for pull dispatch, scatter on the destination for push). Which side is the peer decides
// pull (src = peer window) or push (dst = peer window); the kernels do not care.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/device.cuh"

namespace mok::bench {

struct CopyArgs {
  const char* src;
  char* dst;
  const int* src_idx;  // nullptr: row i
  const int* dst_idx;  // nullptr: row i
  uint32_t rows;
  uint32_t row_bytes;  // multiple of 16
};

// ---------------------------------------------------------------------------------------------
// Bulk-async (TMA 1-D) copy: global -> shared -> global, one CTA per SM, two warps.
// Warp 0 (loader): lane j issues cp.async.bulk of row j of a task into stage s, completing on the
// stage's full mbarrier. Warp 1 (storer): waits full, lane j issues cp.async.bulk of row j from
// shared to global (one bulk group per lane per task); once the group of task k-kLag has been read
// from shared memory (wait_group.read), lane 0 arrives on that stage's empty mbarrier.
// Shared memory: `stages` stages of rows_per_task * row_bytes, plus 2*stages mbarriers.
// ---------------------------------------------------------------------------------------------
namespace ptx {
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_u32(smem_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
}  // namespace ptx

constexpr int kTmaThreads = 64;
constexpr int kTmaLag = 1;

__global__ void __launch_bounds__(kTmaThreads, 1)
    tma_copy_rows(CopyArgs a, uint32_t rows_per_task, uint32_t stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + stages;
  uint8_t* buf = smem + 1024;  // stages <= 64
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t stage_bytes = rows_per_task * a.row_bytes;
  const uint32_t ntasks_all = (a.rows + rows_per_task - 1) / rows_per_task;
  const uint32_t ntasks = ntasks_all > blockIdx.x ? (ntasks_all - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  if (threadIdx.x == 0) {
    for (uint32_t s = 0; s < stages; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 1);
    }
    ptx::mbar_init_fence();
  }
  __syncthreads();
  if (warp == 0) {  // loader
    // Row index of this lane for task k, prefetched one task ahead.
    auto src_row = [&](uint32_t k) -> int {
      const uint32_t row = (blockIdx.x + k * gridDim.x) * rows_per_task + lane;
      if (lane >= rows_per_task || row >= a.rows) return -1;
      return a.src_idx ? a.src_idx[row] : static_cast<int>(row);
    };
    int next = ntasks > 0 ? src_row(0) : -1;
    for (uint32_t k = 0; k < ntasks; ++k) {
      const int mine = next;
      if (k + 1 < ntasks) next = src_row(k + 1);
      const uint32_t s = k % stages;
      if (k >= stages) ptx::mbar_wait(&empty[s], ((k / stages) - 1) & 1);
      const uint32_t row0 = (blockIdx.x + k * gridDim.x) * rows_per_task;
      const uint32_t nr = min(rows_per_task, a.rows - row0);
      if (lane == 0) ptx::mbar_arrive_expect_tx(&full[s], nr * a.row_bytes);
      __syncwarp();
      if (mine >= 0) {
        ptx::bulk_load(buf + s * stage_bytes + lane * a.row_bytes,
                       a.src + static_cast<size_t>(mine) * a.row_bytes, a.row_bytes, &full[s]);
      }
    }
  } else {  // storer
    auto dst_row = [&](uint32_t k) -> int {
      const uint32_t row = (blockIdx.x + k * gridDim.x) * rows_per_task + lane;
      if (lane >= rows_per_task || row >= a.rows) return -1;
      return a.dst_idx ? a.dst_idx[row] : static_cast<int>(row);
    };
    int next = ntasks > 0 ? dst_row(0) : -1;
    for (uint32_t k = 0; k < ntasks; ++k) {
      const int mine = next;
      if (k + 1 < ntasks) next = dst_row(k + 1);
      const uint32_t s = k % stages;
      ptx::mbar_wait(&full[s], (k / stages) & 1);
      if (mine >= 0) {
        ptx::bulk_store(a.dst + static_cast<size_t>(mine) * a.row_bytes, buf + s * stage_bytes + lane * a.row_bytes,
                        a.row_bytes);
      }
      ptx::bulk_commit();
      if (k >= kTmaLag) {
        ptx::bulk_wait_read<kTmaLag>();  // task k-kLag's stage has been read
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty[(k - kTmaLag) % stages]);
      }
    }
    ptx::bulk_wait_all();  // every store complete (written), not only read
  }
}

// ---------------------------------------------------------------------------------------------
// Plain 16-byte loads/stores: one warp per row, 8 independent 16-byte loads per lane in flight
// (4 KB per warp), 32 warps per CTA.
// ---------------------------------------------------------------------------------------------
constexpr int kLdstThreads = 1024;
constexpr int kLdstUnroll = 8;

template <int kUnroll = kLdstUnroll>
__global__ void __launch_bounds__(kLdstThreads, 1) ldst_copy_rows(CopyArgs a) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warps = gridDim.x * (kLdstThreads / 32);
  const uint32_t vecs = a.row_bytes / 16;
  uint32_t row = blockIdx.x * (kLdstThreads / 32) + threadIdx.x / 32;
  auto idx_of = [&](uint32_t r, const int* idx) -> uint32_t { return idx ? static_cast<uint32_t>(idx[r]) : r; };
  uint32_t s_next = row < a.rows ? idx_of(row, a.src_idx) : 0;
  uint32_t d_next = row < a.rows ? idx_of(row, a.dst_idx) : 0;
  for (; row < a.rows; row += warps) {
    const uint32_t s_row = s_next, d_row = d_next;
    if (row + warps < a.rows) {  // prefetch the next row's indices
      s_next = idx_of(row + warps, a.src_idx);
      d_next = idx_of(row + warps, a.dst_idx);
    }
    const int4* src = reinterpret_cast<const int4*>(a.src + static_cast<size_t>(s_row) * a.row_bytes);
    int4* dst = reinterpret_cast<int4*>(a.dst + static_cast<size_t>(d_row) * a.row_bytes);
    for (uint32_t base = 0; base < vecs; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * 32 + lane;
        if (i < vecs) v[u] = src[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * 32 + lane;
        if (i < vecs) dst[i] = v[u];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fill / check patterns (data as 32-bit words).
// ---------------------------------------------------------------------------------------------
__host__ __device__ inline uint32_t word_pattern(uint32_t tag, uint32_t row, uint32_t w) {
  uint32_t x = tag * 0x9E3779B1U ^ row * 0x85EBCA77U ^ w * 0xC2B2AE3DU;
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  return x;
}

__global__ void fill_rows(uint32_t* data, uint32_t rows, uint32_t words, uint32_t tag) {
  const size_t n = static_cast<size_t>(rows) * words;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    data[i] = word_pattern(tag, static_cast<uint32_t>(i / words), static_cast<uint32_t>(i % words));
  }
}

// Counts rows r whose words differ from pattern(tag, src_row) where src_row = src_idx ? src_idx[i]
// : i and r = dst_idx ? dst_idx[i] : i.
__global__ void check_rows(const uint32_t* data, uint32_t rows, uint32_t words, uint32_t tag, const int* src_idx,
                           const int* dst_idx, unsigned long long* bad) {
  unsigned long long b = 0;
  const size_t n = static_cast<size_t>(rows) * words;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t row = static_cast<uint32_t>(i / words), w = static_cast<uint32_t>(i % words);
    const uint32_t s = src_idx ? static_cast<uint32_t>(src_idx[row]) : row;
    const uint32_t d = dst_idx ? static_cast<uint32_t>(dst_idx[row]) : row;
    b += data[static_cast<size_t>(d) * words + w] != word_pattern(tag, s, w);
  }
  if (b) atomicAdd(bad, b);
}

// ---------------------------------------------------------------------------------------------
// Signalling latency: a 256x256 bf16 block (128 KiB) handed back and forth between two ranks.
// Window layout: [0, block) the block, then one 32-bit counter at kSigCounterOffset.
// Each of the k CTAs moves its slice; a hop is complete when every slice has arrived (each
// receiving CTA waits until the counter reaches k * hops received). Each hop adds 1 to every
// 16-bit element, so the final block proves that no hop was lost.
//  push: sender CTA stores its slice into the receiver's block, then red.release.sys +1 on the
//        receiver's counter; the receiver waits (acquire) and then owns the data.
//  pull: the block is ready in the sender's window; sender CTA: red.release.sys +1 on the receiver's
//        counter ("ready"); the receiver waits, loads the slice from the sender (remote loads), adds 1
//        and stores it into its own block; the hop is complete when its loads are done.
// out: [0] ns for `hops` timed hops on rank 0 (after `warm` warm-up hops), [1] wrong words,
//      [2] payload bytes stored to the peer, [3] payload bytes loaded from the peer, [4] flag ops.
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kSigBlockBytes = 256 * 256 * 2;
constexpr size_t kSigCounterOffset = kSigBlockBytes;
constexpr size_t kSigWindowBytes = kSigBlockBytes + 4096;
constexpr int kSigThreads = 512;

__device__ __forceinline__ int4 add_one_bf16x8(int4 v) {
  v.x += 0x00010001;
  v.y += 0x00010001;
  v.z += 0x00010001;
  v.w += 0x00010001;
  return v;
}

template <int kUnits, bool kPush>
__global__ void __launch_bounds__(kSigThreads, 1)
    signal_pingpong(__grid_constant__ const comm::dev::DeviceComm dc, ncclWindow_t w, uint32_t warm, uint32_t hops,
                    unsigned long long* out, uint32_t wait_id) {
  const int peer = dc.rank ^ 1;
  const uint32_t k = gridDim.x;
  const size_t slice = static_cast<size_t>(blockIdx.x) * kSigThreads * kUnits;  // in int4
  int4* mine = comm::dev::local_ptr<int4>(w, 0) + slice;
  int4* theirs = comm::dev::peer_ptr<int4>(w, 0, peer) + slice;
  const uint32_t* my_ctr = comm::dev::local_ptr<uint32_t>(w, kSigCounterOffset);
  uint32_t* peer_ctr = comm::dev::peer_ptr<uint32_t>(w, kSigCounterOffset, peer);
  const uint32_t total = warm + hops;
  uint64_t t0 = 0, t1 = 0;
  uint32_t received = 0;
  unsigned long long stored_bytes = 0, loaded_bytes = 0, flags = 0;
  for (uint32_t h = 0; h < total; ++h) {
    if (h == warm && threadIdx.x == 0) t0 = comm::dev::globaltimer_ns();
    if (static_cast<int>(h % 2) == dc.rank) {  // send
      if (kPush) {
        int4 v[kUnits];
#pragma unroll
        for (int u = 0; u < kUnits; ++u) v[u] = add_one_bf16x8(mine[u * kSigThreads + threadIdx.x]);
#pragma unroll
        for (int u = 0; u < kUnits; ++u) theirs[u * kSigThreads + threadIdx.x] = v[u];
        stored_bytes += sizeof(int4) * kUnits;
      }
      __syncthreads();  // the whole slice, then one release
      if (threadIdx.x == 0) {
        comm::dev::add_release(peer_ctr, 1u);
        ++flags;
      }
    } else {  // receive
      ++received;
      if (!comm::dev::cta_wait_geq(dc, my_ctr, k * received, wait_id, peer)) break;
      if (!kPush) {
        int4 v[kUnits];
#pragma unroll
        for (int u = 0; u < kUnits; ++u) v[u] = theirs[u * kSigThreads + threadIdx.x];
#pragma unroll
        for (int u = 0; u < kUnits; ++u) mine[u * kSigThreads + threadIdx.x] = add_one_bf16x8(v[u]);
        loaded_bytes += sizeof(int4) * kUnits;
        __syncthreads();  // loads done (their values are stored) before this rank signals again
      }
    }
  }
  if (threadIdx.x == 0) t1 = comm::dev::globaltimer_ns();
  // Rank 0 holds the block after the last (odd) hop: every element went through `total` hops.
  unsigned long long bad = 0;
  if (dc.rank == 0) {
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int4 v = mine[u * kSigThreads + threadIdx.x];
      const uint32_t i = static_cast<uint32_t>((slice + u * kSigThreads + threadIdx.x) * 4);
      const uint32_t inc = total * 0x00010001u;
      bad += (static_cast<uint32_t>(v.x) != ((i + 0) & 0x03ff03ffu) + inc) +
             (static_cast<uint32_t>(v.y) != ((i + 1) & 0x03ff03ffu) + inc) +
             (static_cast<uint32_t>(v.z) != ((i + 2) & 0x03ff03ffu) + inc) +
             (static_cast<uint32_t>(v.w) != ((i + 3) & 0x03ff03ffu) + inc);
    }
  }
  if (bad) atomicAdd(&out[1], bad);
  atomicAdd(&out[2], stored_bytes);
  atomicAdd(&out[3], loaded_bytes);
  if (threadIdx.x == 0) {
    atomicAdd(&out[4], flags);
    if (dc.rank == 0 && blockIdx.x == 0) out[0] = t1 - t0;
  }
}

// Initial block on rank 0: word i = i & 0x03ff03ff (two small 16-bit values, no carry for < 64k hops).
__global__ void sig_init(uint32_t* block, uint32_t words) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    block[i] = i & 0x03ff03ffu;
  }
}

}  // namespace mok::bench
