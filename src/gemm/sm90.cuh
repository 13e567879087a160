// mok — SM90 (Hopper, sm_90a) primitives for the GEMM engine.
//
// Raw PTX for what CCCL does not wrap (wgmma, setmaxnreg, stmatrix, elect.sync, named barriers,
// the shared-memory matrix descriptor, tensor-map prefetch); CCCL's cuda::ptx for TMA
// (cp.async.bulk.tensor), mbarrier and proxy fences. Device-only; every wrapper has a GPU unit
// test in tests/gpu/gemm/test_sm90_primitives.cu.
//
// Conventions used throughout src/gemm:
//   * bf16 operands; a "K-major" tile is stored row by row with K contiguous, an "MN-major" tile
//     with M (or N) contiguous;
//   * every operand tile in shared memory uses the 128-byte swizzle that TMA writes with
//     CU_TENSOR_MAP_SWIZZLE_128B: a tile is a stack of 128-byte rows, and the 16-byte unit u of
//     row r lives at unit position u ^ (r % 8). Tiles start at 1024-byte aligned addresses;
//   * K-major tile [rows][64]: row r (an M or N index) at byte r*128 — the wgmma canonical
//     K-major SW128 layout with SBO = 1024 (8 rows) and the K offset added to the start address;
//   * MN-major tile: chunks of 64 M/N values; chunk c holds [64 K rows][64 MN] at c * chunk_bytes,
//     K row k at byte k*128 — the canonical MN-major SW128 layout with LBO = chunk_bytes (next 64
//     MN values) and SBO = 1024 (next 8 K rows).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda/ptx>

#include <cstdint>

#include "common/device_clock.cuh"

namespace mok::gemm::sm90 {

// ------------------------------------------------------------------------------------------------
// Addresses, lanes, warps
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t lane_id() {
  uint32_t l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

// Programmatic dependent launch (kernels launched with the attribute
// cudaLaunchAttributeProgrammaticStreamSerialization): griddep_launch_dependents lets the next
// such kernel in the stream be scheduled before this grid ends; griddep_wait blocks until the
// previous grid in the stream has completed and its memory writes are visible. Without a
// prerequisite grid the wait returns at once.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// elect.sync: true in exactly one active lane of the (fully converged) warp.
__device__ __forceinline__ bool elect_one() {
  uint32_t pred = 0;
  asm volatile(
      "{\n"
      ".reg .b32 rx;\n"
      ".reg .pred px;\n"
      "elect.sync rx|px, %1;\n"
      "selp.u32 %0, 1, 0, px;\n"
      "}\n"
      : "=r"(pred)
      : "r"(0xffffffffu));
  return pred != 0;
}

// Named barriers (ids 1..15; 0 is __syncthreads). `threads` is a multiple of 32.
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Named barrier that also ANDs a predicate over the participating threads (bar.red.and).
__device__ __forceinline__ bool named_bar_and(uint32_t id, uint32_t threads, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.and.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(all)
      : "r"(pred ? 1u : 0u), "r"(id), "r"(threads)
      : "memory");
  return all != 0u;
}

// Register budget of the calling warpgroup (all 128 threads must execute it). Takes effect only
// in kernels with a register cap at entry (__launch_bounds__(threads, 1)).
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: 24..256, step 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: 24..256, step 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

__device__ __forceinline__ uint64_t global_timer_ns() { return mok::globaltimer_ns(); }

// ------------------------------------------------------------------------------------------------
// wgmma
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait points.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(r[i]);
}

#include "gemm/sm90_wgmma.inl"

// Shared-memory matrix descriptor (PTX ISA "matrix descriptor" for wgmma), 128-byte swizzle:
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 49-51 base offset (0: tiles are 1024-byte aligned), 62-63 layout (1 = 128B swizzle).
__host__ __device__ constexpr uint64_t make_desc_sw128(uint32_t smem_byte_addr, uint32_t lbo_bytes,
                                                       uint32_t sbo_bytes) {
  return (uint64_t((smem_byte_addr & 0x3FFFFu) >> 4)) | (uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}
// K-major tile (rows of 64 bf16 = 128 B); k16 selects the 16-wide K slice (0..3).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile_addr, int k16) {
  return make_desc_sw128(tile_addr + uint32_t(k16) * 32u, 16u, 1024u);
}
// MN-major tile made of chunks of [64 K rows][64 MN] (chunk_bytes apart); k16 selects K rows
// 16*k16 .. 16*k16+15.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile_addr, int k16, uint32_t chunk_bytes) {
  return make_desc_sw128(tile_addr + uint32_t(k16) * 2048u, chunk_bytes, 1024u);
}

// Byte offset of bf16 element (row, col) in a 128-byte-swizzled tile of 64-column rows.
__host__ __device__ constexpr uint32_t sw128_offset(uint32_t row, uint32_t col) {
  return row * 128u + ((((col >> 3) ^ (row & 7u)) & 7u) << 4) + (col & 7u) * 2u;
}

// ------------------------------------------------------------------------------------------------
// stmatrix (m8n8, four 8x8 bf16 matrices). Lane l gives the address of row l%8 of matrix l/8;
// register i of lane l holds row l/4, columns 2*(l%4), 2*(l%4)+1 of matrix i (low half first).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_byte_addr, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_byte_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Two floats rounded to nearest-even bf16 and packed (first in the low half).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16_round(float x) {
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return __uint_as_float(uint32_t(h) << 16);
}
// A bf16 pair as loaded from memory (4 bytes: the element at the lower address in the low half),
// each half to fp32.
__device__ __forceinline__ float bf16x2_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// ------------------------------------------------------------------------------------------------
// mbarrier (CCCL) with bounded waits
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  cuda::ptx::mbarrier_init(bar, count);
}
// Makes barrier initialisation visible to the async proxy (TMA) and other threads.
__device__ __forceinline__ void mbar_fence_init() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { (void)cuda::ptx::mbarrier_arrive(bar); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                             cuda::ptx::space_shared, bar, bytes);
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  return cuda::ptx::mbarrier_try_wait_parity(bar, parity);
}

// Non-blocking probe: mbarrier.test_wait never suspends the thread (try_wait may, for an
// implementation-defined time, before it returns false).
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Bound on every in-kernel wait. With `error` null the waits are unbounded. Otherwise a wait that
// lasts longer than limit_ns writes `site` into *error (first one wins) and returns; once *error
// is set every later slow wait returns at once, so a broken pipeline ends the kernel with garbage
// output and a recorded error instead of hanging the GPU.
struct WaitBound {
  unsigned int* error = nullptr;
  unsigned long long limit_ns = 0;
};

// Waits for a phase whose data is already on its way (a TMA / bulk load this thread issued), also
// after another wait on the GPU expired (mbar_wait then returns at once): a CTA must not exit
// while a copy still targets its shared memory. Gives up at `deadline` (globaltimer ns), records
// nothing; false when the phase did not complete in time (e.g. a multicast half that the partner
// never issued).
__device__ __forceinline__ bool mbar_drain(uint64_t* bar, uint32_t parity, uint64_t deadline) {
  for (uint32_t spins = 0;; ++spins) {
    if (mbar_try_wait(bar, parity)) return true;
    if ((spins & 255u) == 255u && global_timer_ns() > deadline) return false;
  }
}

// True once the phase completed; false when this or another wait on the GPU expired (the caller
// then stops issuing work that depends on the phase).
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity, const WaitBound& wb,
                                          unsigned int site) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t t0 = global_timer_ns();
  uint32_t spins = 0;
  while (!mbar_try_wait(bar, parity)) {
    if (wb.error != nullptr && (++spins & 255u) == 0) {
      if (*reinterpret_cast<volatile unsigned int*>(wb.error) != 0u) return false;
      if (global_timer_ns() - t0 > wb.limit_ns) {
        atomicCAS(wb.error, 0u, site);
        return false;
      }
    }
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// Clusters
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// All threads of all CTAs of the cluster; release/acquire orders shared-memory state (barrier
// initialisation) across the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}
// Arrives on the mbarrier at the same shared-memory offset in CTA `cta` of the cluster (default
// .release.cta semantics, as CUTLASS's cluster barriers: the arrival only signals that this
// thread's wgmma reads of its own CTA's stage are complete; a .cluster-scope release costs a
// heavier fence on the consumer's critical path).
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* local_bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 ra;\n"
      "mapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n"
      "}\n" ::"r"(smem_addr(local_bar)),
      "r"(cta)
      : "memory");
}

// Another CTA of the cluster: its shared-memory addresses (mapa), stores into them (st_cluster:
// the run_cta abort flag), and arrivals on its barriers with .release.cluster, which readers there
// pair with .acquire.cluster waits (the forward's cluster task hand-off: the data itself goes
// through global memory, which racecheck sees ordered; written straight into the partner's
// shared memory it was reported as racing with the reads).
__device__ __forceinline__ uint32_t cluster_addr(const void* local, uint32_t cta) {
  uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smem_addr(local)), "r"(cta));
  return ra;
}
__device__ __forceinline__ void st_cluster(uint32_t cluster_address, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(cluster_address), "r"(v) : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote_release(uint64_t* local_bar, uint32_t cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(local_bar, cta))
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// cluster_sync for threads that reach it at different times (no .aligned: warps need not be
// converged), e.g. at the end of a warp-specialised kernel.
__device__ __forceinline__ void cluster_sync_any() {
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;\n" ::
          : "memory");
}

// ------------------------------------------------------------------------------------------------
// TMA (CCCL), proxy fences
// ------------------------------------------------------------------------------------------------
// Shared-memory loads by address (volatile: never moved above the barrier wait that made the
// data visible).
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 lds_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                                            int32_t c1) {
  const int32_t coords[2] = {c0, c1};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords,
                                  bar);
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords,
                                  bar);
}
// Plain (non-tensor) bulk copies of `bytes` (a multiple of 16, 16-byte aligned addresses): global
// -> shared completing on an mbarrier, and shared -> global in the thread's bulk group. Global may
// be a peer GPU's memory (NVLink-mapped). Used by the megakernel's comm CTAs to move token rows.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem_dst, gmem_src, bytes, bar);
}
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, gmem_dst, smem_src, bytes);
}
// Multicast load: the box lands at the same shared-memory offset in every CTA of `cta_mask`, and
// completes bytes on the mbarrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                      int32_t c0, int32_t c1, int32_t c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int32_t c0,
                                             int32_t c1) {
  const int32_t coords[2] = {c0, c1};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords, src);
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int32_t c0,
                                             int32_t c1, int32_t c2) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords, src);
}
// The box at (c0, c1, c2) of `map` += the shared-memory tile (element-wise add done by L2; a bulk
// group like the stores).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int32_t c0,
                                                  int32_t c1, int32_t c2) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_reduce_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add, map,
                                         coords, src);
}
__device__ __forceinline__ void tma_store_commit() { cuda::ptx::cp_async_bulk_commit_group(); }
// Waits until at most kPending committed store groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kPending>{});
}
// Waits until at most kPending committed store groups are still in flight (writes complete).
template <int kPending>
__device__ __forceinline__ void tma_store_wait_all() {
  cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<kPending>{});
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (TMA stores, wgmma operand reads).
__device__ __forceinline__ void fence_async_shared() {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
}

}  // namespace mok::gemm::sm90
