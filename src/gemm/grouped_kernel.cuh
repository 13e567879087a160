// mok — the standalone persistent grouped-GEMM kernel built on the tile engine (engine.cuh).
//
// Included by exactly one .cu per form (grouped_fc1.cu, grouped_plain.cu, grouped_dgrad.cu,
// grouped_dgrad_swiglu.cu, grouped_wgrad.cu), which instantiates
// grouped_gemm_kernel<Cfg<BLOCK_N>, Form> for BLOCK_N 256 and 128 and the launcher.
#pragma once

#include <type_traits>

#include "common/row_copy.cuh"
#include "gemm/engine.cuh"
#include "mok/gemm.hpp"
#include "schedule/schedule_math.h"

static_assert(mok::gemm::engine::kGateUpBox == mok::gemm::kGateUpGroup,
              "the producer's gate/up boxes are the packed order's groups (mok/gemm.hpp)");

namespace mok::gemm::engine {

// Raster inside a grid of num_m x n_tiles tiles (schedule_math.h's tile_raster, shared with the
// backward program's order).
__device__ __forceinline__ void raster(int32_t r, int32_t num_m, int32_t n_tiles, int32_t group_m,
                                       int32_t& m, int32_t& n) {
  const sched::TileMN t = sched::tile_raster(r, num_m, n_tiles, group_m);
  m = t.m;
  n = t.n;
}

// M-grouped tiles (forward, dgrad): the routed buffer's 128-row tiles x the N tiles; the expert of
// each M tile comes from tile_expert (the schedule's table). Static round-robin over CTAs, in
// tile_raster's order or, with group_experts, expert_tile_raster's.
template <class C>
struct MGroupedSchedule {
  int32_t t;
  int32_t total;
  const KernelParams* p;
  __device__ explicit MGroupedSchedule(const KernelParams& params)
      : t(int32_t(blockIdx.x) - int32_t(gridDim.x)), total(params.num_m_tiles * params.n_tiles), p(&params) {}
  __device__ bool next(Tile& out, bool& shared, bool& dummy) {
    shared = dummy = false;
    for (;;) {
      t += int32_t(gridDim.x);
      if (t >= total) return false;
      int32_t m, n;
      if (p->group_experts) {
        const sched::TileMN mn = sched::expert_tile_raster(t, p->num_m_tiles, p->n_tiles, p->group_m, p->tile_expert);
        m = mn.m;
        n = mn.n;
      } else {
        raster(t, p->num_m_tiles, p->n_tiles, p->group_m, m, n);
      }
      const int32_t e = __ldg(p->tile_expert + m);
      if (e < 0) continue;
      out = Tile{m * kBlockM, n * C::kBlockN, e, 0, p->k_blocks, kBlockK, m * kBlockM, 0};
      return true;
    }
  }
};

// 2-CTA clusters: cluster c takes units (pair of M tiles 2i, 2i+1) x (N tile); CTA rank r computes
// M tile 2i + r. B is shared (multicast) when both tiles belong to one expert. A rank without a
// tile (odd tail, skipped tile) recomputes its partner's tile as a dummy: it must take part in
// the pipeline (both CTAs release every stage) but stores nothing.
template <class C>
struct MPairSchedule {
  int32_t u;
  int32_t total;
  int32_t pairs;
  int32_t nclusters;
  uint32_t rank;
  const KernelParams* p;
  __device__ explicit MPairSchedule(const KernelParams& params)
      : pairs((params.num_m_tiles + 1) / 2), nclusters(int32_t(gridDim.x / 2u)), p(&params) {
    rank = cluster_ctarank();
    u = int32_t(blockIdx.x / 2u) - nclusters;
    total = pairs * params.n_tiles;
  }
  __device__ bool next(Tile& out, bool& shared, bool& dummy) {
    for (;;) {
      u += nclusters;
      if (u >= total) return false;
      int32_t mp, n;
      raster(u, pairs, p->n_tiles, max(1, p->group_m / 2), mp, n);
      const int32_t m0 = 2 * mp, m1 = m0 + 1;
      const int32_t e0 = __ldg(p->tile_expert + m0);
      const int32_t e1 = m1 < p->num_m_tiles ? __ldg(p->tile_expert + m1) : -1;
      if (e0 < 0 && e1 < 0) continue;
      int32_t m = rank ? m1 : m0, e = rank ? e1 : e0;
      dummy = e < 0;
      if (dummy) {
        m = rank ? m0 : m1;
        e = rank ? e0 : e1;
      }
      shared = e0 >= 0 && e1 >= 0 && e0 == e1;
      out = Tile{m * kBlockM, n * C::kBlockN, e, 0, p->k_blocks, kBlockK, m * kBlockM, 0};
      return true;
    }
  }
};

// The experts a K-grouped call schedules: all, or KernelParams::expert_range (device, written by
// an earlier kernel: read after griddep_wait), clamped to [0, experts).
struct ExpertRange {
  int32_t first = 0, count = 0;
  __device__ explicit ExpertRange(const KernelParams& p) : count(p.experts) {
    if (p.expert_range == nullptr) return;
    first = min(max(__ldg(p.expert_range), 0), p.experts);
    count = min(max(__ldg(p.expert_range + 1), 0), p.experts - first);
  }
};

// Output tile (m, n) of expert e in a K-grouped call: K runs over the expert's rows in stages of
// C::kBlockK, the last one masked to its valid rows (bf16; FP8's codes are zero there instead).
template <class C>
__device__ __forceinline__ Tile k_grouped_tile(int32_t rows, int32_t begin, int32_t e, int32_t m, int32_t n) {
  const int32_t kb = (rows + C::kBlockK - 1) / C::kBlockK;
  const int32_t valid = rows - (kb - 1) * C::kBlockK;
  return Tile{m * kBlockM, n * C::kBlockN, 0, begin, kb, kb > 0 ? valid : C::kBlockK, m * kBlockM, e};
}
template <class C>
__device__ __forceinline__ Tile k_grouped_tile(const KernelParams& p, int32_t e, int32_t m, int32_t n) {
  return k_grouped_tile<C>(__ldg(p.expert_rows + e), __ldg(p.expert_row_begin + e), e, m, n);
}

// K-grouped tiles (wgrad): per expert, its M x N output tiles; K runs over the expert's rows. The
// bf16 instance decodes on divisors made once (sched::div_by, sched::RasterPlan: the same tiles as
// integer division; the forms +0.2..+2.6%, f66f864); the FP8 one keeps integer division (3-14%
// slower with the divisors, measured at b116aa3: notes/gemm.md).
template <class C>
struct KGroupedSchedule {
  static constexpr bool kFastDiv = std::is_same_v<typename C::Operand, OperandBf16>;
  int32_t t;
  int32_t total;
  int32_t first;
  sched::Divisor per_e;
  sched::RasterPlan plan;
  const KernelParams* p;
  __device__ explicit KGroupedSchedule(const KernelParams& params)
      : t(int32_t(blockIdx.x) - int32_t(gridDim.x)), p(&params) {
    const ExpertRange r(params);
    first = r.first;
    total = r.count * params.num_m_tiles * params.n_tiles;
    if constexpr (kFastDiv) {
      per_e = sched::divisor(max(1, params.num_m_tiles * params.n_tiles));
      plan = sched::raster_plan(max(1, params.num_m_tiles), params.n_tiles, max(1, params.group_m));
    }
  }
  __device__ bool next(Tile& out, bool& shared, bool& dummy) {
    shared = dummy = false;
    t += int32_t(gridDim.x);
    if (t >= total) return false;
    if constexpr (kFastDiv) {
      const int32_t local = sched::div_by(t, per_e);
      const sched::TileMN mn = sched::tile_raster(t - local * per_e.d, plan);
      out = k_grouped_tile<C>(*p, first + local, mn.m, mn.n);
    } else {
      const int32_t per_e_tiles = p->num_m_tiles * p->n_tiles;
      const int32_t local = t / per_e_tiles;
      const int32_t e = first + local;
      int32_t m, n;
      raster(t - local * per_e_tiles, p->num_m_tiles, p->n_tiles, p->group_m, m, n);
      out = k_grouped_tile<C>(*p, e, m, n);
    }
    return true;
  }
};

// 2-CTA clusters for wgrad: the two CTAs take output M tiles 2i and 2i+1 of the same expert and N
// tile, so B (the activations over the expert's rows) is always shared; an odd last M tile is
// recomputed by rank 1 as a dummy.
template <class C>
struct KPairSchedule {
  int32_t u;
  int32_t total;
  int32_t first;
  int32_t pairs;
  int32_t nclusters;
  uint32_t rank;
  const KernelParams* p;
  __device__ explicit KPairSchedule(const KernelParams& params)
      : pairs((params.num_m_tiles + 1) / 2), nclusters(int32_t(gridDim.x / 2u)), p(&params) {
    rank = cluster_ctarank();
    u = int32_t(blockIdx.x / 2u) - nclusters;
    const ExpertRange r(params);
    first = r.first;
    total = r.count * pairs * params.n_tiles;
  }
  __device__ bool next(Tile& out, bool& shared, bool& dummy) {
    u += nclusters;
    if (u >= total) return false;
    const int32_t per_e = pairs * p->n_tiles;
    const int32_t local = u / per_e;
    const int32_t e = first + local;
    int32_t mp, n;
    raster(u - local * per_e, pairs, p->n_tiles, max(1, p->group_m / 2), mp, n);
    const int32_t m0 = 2 * mp;
    const bool has1 = m0 + 1 < p->num_m_tiles;
    dummy = rank == 1u && !has1;
    shared = has1;
    const int32_t m = dummy ? m0 : m0 + int32_t(rank);
    out = k_grouped_tile<C>(*p, e, m, n);
    return true;
  }
};

// ------------------------------------------------------------------------------------------------
// Forms: operand layouts, schedule and epilogue
// ------------------------------------------------------------------------------------------------
// FC1: A = routed x [rows, H] (K-major), B = [W_gate; W_up] in packed order (K-major, from the
// two weights: map_b, map_b_half, p.b_gate_up). Epilogue: the gate/up pre-activations (bf16,
// packed order) to map_d0 [rows, 2I] if store_gu, and h = silu(g) * u to map_d1 [rows, I].
// kSplitN: the form can run a tile whose tokens fit in 64 rows in split-N form (K-major A and B),
// with epilogue_split. At BLOCK_N 256 a warpgroup's half holds whole h chunks (128 packed
// columns -> 64 h columns, TMA-stored); at 128 it holds half a chunk, stored directly.
template <class C>
struct FormFc1 {
  static constexpr bool kAMN = false, kBMN = false, kMaskK = false;
  static constexpr bool kGateUpB = true;  // B may be a gate/up pair (p.b_gate_up; FC1: always)
  static constexpr bool kCarry = false;   // no partial sums across calls (FormWgrad only)
  static constexpr bool kSplitN = true;
  using Schedule = MGroupedSchedule<C>;
  using PairSchedule = MPairSchedule<C>;
  __device__ __forceinline__ static void epilogue(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                  uint32_t wt, const float (&acc)[C::kAccRegs],
                                                  const CUtensorMap* d0, const CUtensorMap* d1,
                                                  const KernelParams& p) {
    epilogue_fc1<C>(sm, es, cwg, wt, acc, p.store_gu ? d0 : nullptr, t.out_row, d1, t.out_row, t.b_n, p.n);
  }
  __device__ __forceinline__ static void epilogue_split(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                        uint32_t wt, const float (&acc)[C::kAccRegs],
                                                        const CUtensorMap* d0, const CUtensorMap* d1,
                                                        const KernelParams& p) {
    epilogue_fc1_split_n<C>(sm, es, cwg, wt, acc, p.store_gu ? d0 : nullptr, t.out_row, d1, t.out_row, t.b_n, p.n);
    if constexpr (C::kBlockN == 128) store_h_split_n_direct<C>(acc, wt, cwg, p.fc1_h, t.out_row, t.b_n, p.n / 2);
  }
};

// Plain bf16 store of the 128 x BLOCK_N tile to map_d0 [rows, N]. This is the FC2 epilogue; the
// combine scatter (rows pushed to their source slots) will replace it with per-row stores.
template <class C, bool kBMNArg>
struct FormStore2d {
  static constexpr bool kAMN = false, kBMN = kBMNArg, kMaskK = false;
  static constexpr bool kGateUpB = kBMNArg;  // Dgrad: FC1's dgrad reads [W_gate; W_up]
  static constexpr bool kCarry = false;
  static constexpr bool kSplitN = !kBMNArg;  // K-major B: halves of 128 or 64 columns
  using Schedule = MGroupedSchedule<C>;
  using PairSchedule = MPairSchedule<C>;
  __device__ __forceinline__ static void epilogue(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                  uint32_t wt, const float (&acc)[C::kAccRegs],
                                                  const CUtensorMap* d0, const CUtensorMap*,
                                                  const KernelParams& p) {
    epilogue_store<C>(sm, es, cwg, wt, acc, d0, t.out_row, t.b_n, p.n);
  }
  __device__ __forceinline__ static void epilogue_split(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                        uint32_t wt, const float (&acc)[C::kAccRegs],
                                                        const CUtensorMap* d0, const CUtensorMap*,
                                                        const KernelParams& p) {
    epilogue_store_split_n<C>(sm, es, cwg, wt, acc, d0, t.out_row, t.b_n, p.n);
  }
};
template <class C>
using FormPlain = FormStore2d<C, false>;
template <class C>
using FormDgrad = FormStore2d<C, true>;

// FC1's dgrad with the reverse dispatch in its epilogue (plan_dgrad_scatter): FormDgrad's
// mainloop, each row stored at its token's slot (epilogue_scatter_rows) instead of to map_d0.
template <class C>
struct FormDgradScatter {
  static constexpr bool kAMN = false, kBMN = true, kMaskK = false, kSplitN = false, kGateUpB = true;
  static constexpr bool kCarry = false;
  using Schedule = MGroupedSchedule<C>;
  using PairSchedule = MPairSchedule<C>;
  __device__ __forceinline__ static void epilogue(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                  uint32_t wt, const float (&acc)[C::kAccRegs],
                                                  const CUtensorMap*, const CUtensorMap*, const KernelParams& p) {
    epilogue_scatter_rows<C>(sm, es, cwg, wt, acc, p.scatter_rank, p.scatter_slot, p.scatter_to, p.scatter_abort,
                             p.error, p.scatter_row_base, t.out_row, t.b_n, p.n);
  }
};

// FC2's dgrad fused with the SwiGLU backward: A = d_y [rows, hidden] (K-major), B = W_down
// [E, hidden, inter] (MN-major, as Dgrad); the epilogue turns d_h (registers only) and the
// forward's packed gate/up pre-activations p.gu into d_gu [rows, 2 * inter] at map_d0 (packed);
// with p.row_weight, A holds unweighted rows, the router-weight gradient's partial sums go to
// p.router_partial and h (p.fc1_h) is written rnd(w * rnd(silu(g) u)) (epilogue_dgrad_swiglu).
// kGuAhead: epilogue_dgrad_swiglu's gate/up chunks in flight (2 for the standalone bf16 form,
// FormDgradSwiGLU2; 1 in the FP8 form and the backward program, whose consumers would spill).
template <class C, int kGuAhead = 1>
struct FormDgradSwiGLU {
  static constexpr bool kAMN = false, kBMN = true, kMaskK = false, kSplitN = false, kGateUpB = false;
  static constexpr bool kCarry = false;
  static constexpr bool kPullRows = true;  // DgradSwiGLUArgs::pull (pull_rows_beside)
  using Schedule = MGroupedSchedule<C>;
  using PairSchedule = MPairSchedule<C>;
  __device__ __forceinline__ static void epilogue(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                  uint32_t wt, const float (&acc)[C::kAccRegs],
                                                  const CUtensorMap* d0, const CUtensorMap*,
                                                  const KernelParams& p) {
    epilogue_dgrad_swiglu<C, kGuAhead>(sm, es, cwg, wt, acc, p.gu, d0, t.out_row, t.b_n, p.n, p.row_weight,
                                       p.router_partial, p.router_parts, p.fc1_h);
  }
};
template <class C>
using FormDgradSwiGLU2 = FormDgradSwiGLU<C, 2>;

// Wgrad: dw [E, M, N] (3-D map_d0) of expert e = a_e^T . b_e, where a = [rows, M] and b = [rows, N]
// (both MN-major operands); the last K block of each expert is masked to its valid rows. With
// p.split_gate_up, M is a packed gate/up width and the rows go to map_d0 (gate) / map_d1 (up).
// kAccumulate (FormWgradAccumulate, bf16, WgradArgs::accumulate): the tile's fp32 sums are added to
// the fp32 gradients behind map_d0 / map_d1 (F32Tile maps) by TMA reduce-adds instead (a kernel of
// its own, so the plain form's code stays as it was).
template <class C, bool kAccumulate = false>
struct FormWgradT {
  static constexpr bool kAMN = true, kBMN = true, kMaskK = true, kSplitN = false, kGateUpB = false;
  static constexpr bool kCarry = true;
  using Schedule = KGroupedSchedule<C>;
  using PairSchedule = KPairSchedule<C>;
  // Carry (WgradArgs::carry_in / carry_out): thread ct's accumulators of output tile (m, n) at
  // [tile][i / 4][ct][i % 4] floats (float4 accesses, coalesced over the threads).
  __device__ __forceinline__ static int64_t carry_offset(const Tile& t, const KernelParams& p, uint32_t ct) {
    const int32_t tile = (t.out_row / kBlockM) * p.n_tiles + t.b_n / C::kBlockN;
    return int64_t(tile) * 256 * C::kAccRegs + int64_t(ct) * 4;
  }
  // Whether the tile's expert continues the sums an earlier call left in carry_in.
  __device__ __forceinline__ static bool carried_in(const Tile& t, const KernelParams& p) {
    return p.carry_in != nullptr && t.out_batch == __ldg(p.carry_experts);
  }
  // Before the tile's MMAs: the expert continued from an earlier call starts from its sums.
  __device__ __forceinline__ static bool load_carry(const Tile& t, uint32_t ct, float (&acc)[C::kAccRegs],
                                                    const KernelParams& p) {
    if (!carried_in(t, p)) return false;
    const float* c = p.carry_in + carry_offset(t, p, ct);
#pragma unroll
    for (int i = 0; i < C::kAccRegs; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(c + i * 256);
      acc[i] = v.x, acc[i + 1] = v.y, acc[i + 2] = v.z, acc[i + 3] = v.w;
    }
    return true;
  }
  __device__ __forceinline__ static void epilogue(const Smem<C>& sm, EpiState& es, const Tile& t, int cwg,
                                                  uint32_t wt, const float (&acc)[C::kAccRegs],
                                                  const CUtensorMap* d0, const CUtensorMap* d1,
                                                  const KernelParams& p) {
    // An expert without rows here that has rows in another call: that call writes it.
    if (t.k_blocks == 0 && p.expert_rows_total != nullptr && __ldg(p.expert_rows_total + t.out_batch) > 0) return;
    if (p.carry_out != nullptr && t.out_batch == __ldg(p.carry_experts + 1)) {  // continued in a later call
      float* c = p.carry_out + carry_offset(t, p, uint32_t(cwg) * 128u + wt);
#pragma unroll
      for (int i = 0; i < C::kAccRegs; i += 4)
        *reinterpret_cast<float4*>(c + i * 256) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
      return;
    }
    if (t.out_row + 64 * cwg >= p.m_out) return;
    if constexpr (kAccumulate) {  // added to the fp32 gradients (nothing to add without rows or carry)
      static_assert(std::is_same_v<typename C::Operand, OperandBf16>, "the bf16 weight gradient only");
      if (t.k_blocks > 0 || carried_in(t, p))
        epilogue_accumulate_tma<C>(sm, es, cwg, wt, acc, d0, p.split_gate_up ? d1 : nullptr, t.out_row, t.b_n, p.n,
                                   t.out_batch);
    } else if constexpr (!std::is_same_v<typename C::Operand, OperandBf16>) {
      // FP8: chunks in batches of two (measured faster there; slower in BF16: engine_epilogue.cuh).
      epilogue_wgrad_batched<C>(sm, es, cwg, wt, acc, d0, p.split_gate_up ? d1 : nullptr, t.out_row, t.b_n, p.n,
                                t.out_batch);
    } else if (p.split_gate_up) {
      // BF16: TMA-staged chunks. Stores straight from the registers (8 bytes a lane, whole sectors,
      // no barrier) measured 3-16% slower (notes/gemm.md).
      epilogue_store_gate_up<C>(sm, es, cwg, wt, acc, d0, d1, t.out_row, t.b_n, p.n, t.out_batch);
    } else {
      epilogue_store<C>(sm, es, cwg, wt, acc, d0, t.out_row, t.b_n, p.n, t.out_batch);
    }
  }
};
template <class C>
using FormWgrad = FormWgradT<C, false>;
template <class C>
using FormWgradAccumulate = FormWgradT<C, true>;

// A weight-gradient tile whose expert starts before the call's rows (held rows, k_begin < 0) that
// the hold does not cover (WgradArgs::hold_*: at most hold_a_row / hold_b_row rows, or no hold):
// not computed, by the producer and the consumers alike (the same stages), and recorded
// (kSiteHeldRows) rather than read as the zeros a TMA load before a map's first row gives.
__device__ __forceinline__ bool held_rows_misfit(Tile& t, const KernelParams& p) {
  if (t.k_blocks == 0 || t.k_begin >= 0) return false;
  if (p.hold != 0 && -t.k_begin <= p.hold_a_row && -t.k_begin <= p.hold_b_row) return false;
  t.k_blocks = 0;
  return true;
}

// Whether a form's producer warpgroup runs KernelParams::pull_* in its idle warps (kPullRows:
// FC2's dgrad only. In the weight gradients the same code made ptxas spill 16-32 bytes, and with
// the router weights the dgrad's too, 2026-12-08).
template <class F, class = void>
struct PullsRows : std::false_type {};
template <class F>
struct PullsRows<F, std::void_t<decltype(F::kPullRows)>> : std::bool_constant<F::kPullRows> {};

// The rows of a RowPull (KernelParams::pull_*) copied by warps 1-3 of every CTA's producer
// warpgroup, which have nothing else to do (warp 0 issues the loads): one warp per row, the rows
// strided over the grid's 3 x gridDim.x warps, beside the consumers' MMAs. Within the producer's
// register budget (kProducerRegs: two 16-byte vectors in flight a lane; four spilled). Stops once
// the abort word is set (checked every 16 rows of a warp), like the movement kernels.
__device__ __forceinline__ void pull_rows_beside(const KernelParams& p, uint32_t warp) {
  // (32-bit row counts, pointers advanced once: the producer's 40 registers; a window's rows fit
  // int32, as every routed row offset does)
  const int64_t total = *p.pull_total;  // (written by the schedule's build: a kernel long done)
  const int64_t end = p.pull_row_end < 0 || p.pull_row_end > total ? total : p.pull_row_end;
  const int32_t count = end > p.pull_row_begin ? int32_t(end - p.pull_row_begin) : 0;
  const int32_t* rank = p.pull_rank + p.pull_row_begin;
  const int32_t* slot_of = p.pull_slot + p.pull_row_begin;
  const int lane = int(threadIdx.x & 31u);
  const int32_t warps = int32_t(gridDim.x) * 3;
  const int vecs = p.pull_vecs;
  // The row a warp copies next, fetched into L2 by one bulk prefetch (TMA) while it copies this
  // one: three warps an SM keep ~3 KB of loads in flight (two vectors a lane), so each row's loads
  // find it in L2 instead of paying HBM's (or NVLink's) latency.
  const auto prefetch = [&](int32_t local) {
    if (lane != 0 || local >= count) return;
    const int src = __ldg(rank + local);
    if (src < 0) return;
    const uint4* row = reinterpret_cast<const uint4* const*>(p.pull_from)[src] +
                       int64_t(__ldg(slot_of + local) / p.pull_top_k) * vecs;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(uint32_t(vecs) * 16u) : "memory");
  };
  int32_t local = int32_t(blockIdx.x) * 3 + int32_t(warp) - 1;
  prefetch(local);
  for (int n = 0; local < count; local += warps) {
    if ((n++ & 15) == 0 && gpu::abort_seen(p.pull_abort)) return;
    prefetch(local + warps);
    const int src = __ldg(rank + local);
    uint4* dst = static_cast<uint4*>(p.pull_to) + int64_t(local) * vecs;
    if (src >= 0) {
      const int slot = __ldg(slot_of + local);
      const uint4* row = reinterpret_cast<const uint4* const*>(p.pull_from)[src] + int64_t(slot / p.pull_top_k) * vecs;
      gpu::copy_row<2>(row, dst, vecs, lane);
    } else {
      gpu::zero_row(dst, vecs, lane);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The kernel: one CTA per SM, persistent over the form's schedule.
// ------------------------------------------------------------------------------------------------
template <class C, template <class> class FormT, bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_b_half,
                        const __grid_constant__ CUtensorMap map_d0,
                        const __grid_constant__ CUtensorMap map_d1,
                        const __grid_constant__ CUtensorMap map_a_hold,
                        const __grid_constant__ CUtensorMap map_b_hold, const KernelParams p) {
  using Form = FormT<C>;
  using Schedule = std::conditional_t<kCluster, typename Form::PairSchedule, typename Form::Schedule>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem<C> sm = smem_view<C>(smem_raw);
  if (threadIdx.x == 0) init_barriers(sm, kCluster ? 2u : 1u);
  if constexpr (kCluster)
    cluster_sync();  // the partner's barriers are initialised before any remote arrival
  else
    __syncthreads();
  // Programmatic dependent launch (Options::pdl): the next kernel may be scheduled now (it waits
  // for this grid to complete before touching memory, as this one does for its predecessor), and
  // nothing below reads or writes global memory before the previous grid has completed.
  griddep_launch_dependents();
  griddep_wait();
  const WaitBound wb{p.error, p.wait_limit_ns};
  const uint32_t warp = threadIdx.x / 32u;
  const uint32_t rank = kCluster ? cluster_ctarank() : 0u;
  bool shared = false, dummy = false;

  if (threadIdx.x < 128) {
    // Producer warpgroup: one thread issues every load.
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && elect_one()) {
      prefetch_tensor_map(&map_a);
      prefetch_tensor_map(&map_b);
      if (Form::kGateUpB && p.b_gate_up != 0) prefetch_tensor_map(&map_b_half);  // the up weights
      // Held rows (the weight gradients, WgradArgs::hold_*; not with clusters, whose producer has no
      // registers left for them): K blocks below 0 from the hold maps.
      HoldMaps held;
      if (Form::kCarry && !kCluster && p.hold != 0) {
        held = HoldMaps{&map_a_hold, &map_b_hold, p.hold_a_row, p.hold_b_row};
        prefetch_tensor_map(&map_a_hold);
        prefetch_tensor_map(&map_b_hold);
      }
      PipeState<C> ps;
      Tile t;
      Schedule sched(p);
      while (sched.next(t, shared, dummy)) {
        if constexpr (Form::kCarry) held_rows_misfit(t, p);
        if (!produce_tile<C, Form::kAMN, Form::kBMN, kCluster>(sm, ps, t, &map_a, &map_b, wb, &map_b_half, shared,
                                                               rank, Form::kGateUpB && p.b_gate_up != 0,
                                                               NoStageExtra{}, held))
          break;  // a wait expired: issue nothing more
      }
      drain_stages(sm, ps, wb);
      if constexpr (kCluster) producer_tail(sm, ps, wb);
    } else if constexpr (PullsRows<Form>::value) {
      if (warp != 0 && p.pull_to != nullptr) pull_rows_beside(p, warp);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int cwg = int(threadIdx.x / 128u) - 1;
    const uint32_t wt = threadIdx.x % 128u;
    const uint32_t ct = threadIdx.x - 128u;
    if (ct == 0) {
      prefetch_tensor_map(&map_d0);
      prefetch_tensor_map(&map_d1);
    }
    PipeState<C> ps;
    EpiState es;
    Tile t;
    Schedule sched(p);
    Skew<C> skew;
    skew.stages = p.skew_stages;
    float acc[C::kAccRegs];
    while (sched.next(t, shared, dummy)) {
      if constexpr (Form::kSplitN) {
        // Token rows of the tile (M-grouped forms: t.b_batch is its expert, t.a_m its first row);
        // a begin past the tile (a caller's layout other than the padded one) never splits.
        const int32_t begin = p.expert_rows != nullptr ? __ldg(p.expert_row_begin + t.b_batch) : 0;
        if (p.expert_rows != nullptr && t.a_m >= begin && begin + __ldg(p.expert_rows + t.b_batch) - t.a_m <= 64) {
          mma_tile_split_n<C, kCluster>(sm, ps, t, cwg, acc, wb, rank ^ 1u);
          if (!dummy) Form::epilogue_split(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
          continue;
        }
      }
      bool accumulate = false;
      if constexpr (Form::kCarry) {
        if (held_rows_misfit(t, p) && ct == 0 && p.error != nullptr) atomicCAS(p.error, 0u, kSiteHeldRows);
        accumulate = Form::load_carry(t, ct, acc, p);
      }
      mma_tile<C, Form::kAMN, Form::kBMN, Form::kMaskK, kCluster>(sm, ps, t, cwg, ct, acc, wb, skew, rank ^ 1u,
                                                                  NoHook{}, accumulate);
      if (!dummy) Form::epilogue(sm, es, t, cwg, wt, acc, &map_d0, &map_d1, p);
    }
    epi_finish(wt == 0);
  }
  // Clusters: neither CTA exits while the partner may still multicast into it or arrive on its
  // barriers (after an expired wait producer_tail returns early).
  if constexpr (kCluster) cluster_sync_any();
}

}  // namespace mok::gemm::engine
