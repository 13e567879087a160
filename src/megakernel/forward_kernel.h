// mok — the BF16 forward megakernel (host interface). One persistent kernel per rank and forward
// call: the first `plan.comm_ctas` CTAs pull routed rows from the peers into the ring and push
// FC2 rows back into the owners' combine slots (or, with push dispatch, push this rank's tokens
// into the receivers' rings instead of pulling); the other CTAs claim FC1 (+SwiGLU), FC2 and
// shared-expert tiles from an atomic ticket and run them on the SM90 tile engine. The plan,
// ticket order and dependency counters are in forward_plan.h; the kernel in forward_kernel.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "comm/device.cuh"
#include "megakernel/forward_plan.h"
#include "megakernel/forward_setup.h"
#include "schedule/schedule_gpu.h"

namespace mok::mk {

// TMA tensor maps (bf16, 128-byte swizzle). A operands: box 128 rows; outputs: box 64 rows;
// weights: 3-D [E, N, K] with box BLOCK_N rows, the gate/up weights (FC1's B, read where the
// caller keeps them) with boxes of 32 rows (the engine's produce_tile, gate_up).
struct ForwardMaps {
  CUtensorMap x_ring;    // A of FC1: ring [R, H]
  CUtensorMap w_gate;    // B of FC1, with w_up: [E_loc, I, H] each
  CUtensorMap gu;        // FC1 out: gate/up pre-activations [cap_rows, 2I] (every routed row; rows
                         // 64-127 of a tile whose tokens fit in rows 0-63 are padding and stay
                         // unwritten, so padding rows of gu are undefined)
  CUtensorMap h_out;     // FC1 out: ring [R, I]
  CUtensorMap h_in;      // A of FC2: ring [R, I]
  CUtensorMap w_down;    // B of FC2: [E_loc, H, I]
  CUtensorMap y_out;     // FC2 out: ring [R, H]
  CUtensorMap xs_in;     // shared expert A: this rank's x [s_tiles*128, H]
  CUtensorMap ws_gate;   // [1, Is, H]
  CUtensorMap gus_out;   // [s_tiles*128, 2Is]
  CUtensorMap hs_out;    // [s_tiles*128, Is]
  CUtensorMap hs_in;     // [s_tiles*128, Is]
  CUtensorMap ws_down;   // [1, H, Is]
  CUtensorMap ys_out;    // [s_tiles*128, H]
  CUtensorMap w_up;      // [E_loc, I, H]
  CUtensorMap ws_up;     // [1, Is, H]
  // Clusters: the FC2 weight maps with a box of BLOCK_N/2 rows (each CTA multicasts half a B tile).
  CUtensorMap w_down_half;
  CUtensorMap ws_down_half;
};

struct ForwardParams {
  PlanShape plan;
  CounterLayout layout;
  uint32_t* counters = nullptr;  // layout.words() words, zero at launch
  gpu::ScheduleView schedule;
  const void* const* x_peers = nullptr;  // [W] rank r's x [T_r, H] (flat peer aliases)
  // One GPU, bf16, no shared expert: the caller's x [T, H], read in place of the x window (no
  // peer reads the window, so the forward copies nothing there); null otherwise.
  const void* x_local = nullptr;
  void* const* combine_peers = nullptr;  // [W] rank r's combine slots [T_r * k, H]
  void* x_ring = nullptr;                // [R, H] (written by the comm CTAs)
  const void* y_ring = nullptr;          // [R, H] (read by the comm CTAs)
  int32_t hidden = 0, inter = 0, shared_inter = 0, top_k = 0;
  int32_t tokens = 0;  // this rank's T (rows of the shared expert's tiles)
  // 0: FC1 epilogues skip the gate/up pre-activations of the routed rows (a forward without
  // backward, or a backward over windows, which recomputes them) / of the shared expert's rows.
  int32_t save_gu = 1;
  int32_t save_gu_shared = 1;
  int32_t combine_in_epilogue = 0;  // 1: FC2 tiles store rows into combine_peers, comm CTAs only pull
  int32_t skew_stages = 0;  // stagger of the consumer warpgroups in K blocks (engine's Skew; 0 = off)
  int32_t split_n = 1;      // tiles with <= 64 token rows: both warpgroups on those rows (0: warpgroup 0 alone)
  int32_t cluster = 0;      // 1: 2-CTA clusters, tickets are pairs of M tiles (plan.pair), B multicast
  int32_t mover_rounds = 0;  // 1: the comm CTAs' movers take one row per round, a CTA barrier between
                             // rounds (forward_comm.cuh: for racecheck); 0: each mover runs on alone
  // Clusters: rank 0 hands rank 1 its tasks through global memory, kForwardTaskSlots slots of
  // kForwardTaskSlotBytes per cluster (cluster c = blockIdx.x / 2), kForwardClusterSlotBytes(grid).
  void* cluster_slots = nullptr;
  // Push dispatch (1): instead of pulling, this rank's comm CTAs write its own tokens into every
  // receiver's ring, position by position, and count each position on the receiver's pulled[g]
  // (so FC1 there waits for W x C arrivals, system-scope acquire). A sender writes position g of
  // receiver d once d's FC2 of g - S is complete (its x rows are then free; FC1(g) waits for it
  // anyway). Counters and rings are then symmetric windows; `counters` is this rank's block.
  int32_t push_dispatch = 0;
  const gpu::ScheduleView* dest_schedules = nullptr;  // [W] each receiver's schedule, built on this GPU
  void* const* ring_peers = nullptr;                  // [W] each receiver's x ring [R, H]
  uint32_t* const* counter_peers = nullptr;           // [W] each receiver's counter block
  unsigned long long* stats = nullptr;  // optional profile: kForwardStatWords per CTA (see the kernel)
  // FP8 / MXFP8 (forward_kernel_fp8.cu, forward_kernel_mxfp8.cu): the rings hold E4M3 codes, with their
  // 1 x 128 scales beside them; the weights' 128 x 128 scales ([E, N / 128, K / 128]).
  float* x_scales_ring = nullptr;  // [R, H / 128] (written by the comm CTAs)
  void* h_ring = nullptr;          // [R, I] E4M3 codes (FC1's epilogue)
  float* h_scales_ring = nullptr;  // [R, I / 128]
  const float* w_gate_scales = nullptr;
  const float* w_up_scales = nullptr;
  const float* w_down_scales = nullptr;
  int64_t x_scale_offset = 0;  // bytes from a rank's x window (codes) to its scales
};

inline constexpr int kForwardStatWords = 12;
// The kernel-internal wait sites that the megakernel and the GEMM engine record in the abort word
// when a shared-memory pipeline wait expires, with their names for error messages (the codes are
// defined beside the waits; forward_kernel.cu checks that they agree with this list).
struct WaitSite {
  unsigned int code;
  const char* name;
};
inline constexpr WaitSite kWaitSites[] = {{0x6e01, "gemm.producer_empty_stage"},
                                          {0x6e02, "gemm.consumer_full_stage"},
                                          {0x6e03, "gemm.consumer_skew"},
                                          {0x6e10, "megakernel.task_slot_handoff"},
                                          {0x6e11, "megakernel.comm_row_load"}};
// The profile words of one CTA (MOK_PROFILE=1; ForwardParams::stats, kForwardStatWords each), by
// role. Times in globaltimer ns, except kStatCycles (clock64 cycles).
enum CommStat : int { kStatCommSpan = 0, kStatPull = 1, kStatPush = 2, kStatIdle = 3 };
enum ComputeStat : int {
  kStatSpan = 0,        // the CTA's whole run
  kStatBusy = 1,        // inside tiles
  kStatWaitTask = 2,    // consumers waiting for the next task
  kStatDeps = 3,        // the producer waiting on dependencies
  kStatTiles = 4,       // tiles computed (a count)
  kStatFirstStage = 5,  // waiting for a tile's first stage
  kStatEpilogue = 6,    // in epilogues
  kStatFc2 = 7,         // inside FC2 tiles
  kStatFc2Tiles = 8,    // FC2 tiles (a count)
  kStatMulticast = 9,   // tiles whose B was multicast (a count)
  kStatCycles = 10,     // clock64 cycles over the run (the SM clock)
};

// Dynamic shared memory of one CTA.
int forward_smem_bytes();
// Largest hidden size whose rows fit a comm CTA's shared memory (zero row + one row buffer).
int forward_max_hidden();
// Once per layer (current device): checks the comm/compute split and that the CTAs (one per SM)
// can all be resident, and sets the kernel's shared-memory attribute. Returns the grid to launch:
// `grid`, or with clusters the largest even grid <= `grid` whose pairs all fit.
int prepare_forward(int comm_ctas, int grid, bool cluster);
// Launches the megakernel on `grid` CTAs (cooperative: all resident or the launch fails).
void launch_forward(const ForwardMaps& maps, const ForwardParams& params, const comm::dev::DeviceComm& dc,
                    int grid, cudaStream_t stream);

// The same program on block-scaled FP8 operands (forward_kernel_fp8.cu; Config::precision FP8):
// the maps are E4M3 ones (x ring, h ring, weights), ForwardParams carries the scales; no clusters.
namespace fp8 {
int forward_smem_bytes();
int forward_max_hidden();
int prepare_forward(int comm_ctas, int grid, bool cluster);
void launch_forward(const ForwardMaps& maps, const ForwardParams& params, const comm::dev::DeviceComm& dc,
                    int grid, cudaStream_t stream);
}  // namespace fp8
namespace mxfp8 {  // the same with h as MXFP8 re-blocked to 1 x 128 (forward_kernel_mxfp8.cu)
int forward_smem_bytes();
int forward_max_hidden();
int prepare_forward(int comm_ctas, int grid, bool cluster);
void launch_forward(const ForwardMaps& maps, const ForwardParams& params, const comm::dev::DeviceComm& dc,
                    int grid, cudaStream_t stream);
}  // namespace mxfp8

}  // namespace mok::mk
