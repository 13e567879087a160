// mok — the backward's GEMM program (see backward_program.h; its ticket order and dependencies:
// backward_plan.h, "the backward's GEMM program").
//
// Every CTA (384 threads, one per SM) is a compute CTA of the megakernel runtime (rt::run_cta
// without comm CTAs): its producer thread claims a ticket, waits for the D2 tiles the task needs
// (bounded, gpu-scope acquire, then a proxy fence before its TMA loads), hands the tile to the two
// consumer warpgroups through the runtime's task ring and issues the tile's loads; the consumers
// run the tile's MMAs and the epilogue of the form the unfused GEMM uses. After a D2 tile each
// warpgroup makes its stores visible to the TMA loads of later tiles — d_gu (TMA stores: waited
// for) and the weighted h (every thread's own stores: a proxy fence each, then the warpgroup's
// barrier) — and its leader releases the M tile's counter.
#include <cuda_runtime.h>

#include <atomic>

#include "common/cuda_check.h"
#include "gemm/grouped_kernel.cuh"
#include "megakernel/backward_plan.h"
#include "megakernel/backward_program.h"
#include "megakernel/runtime.cuh"
#include "mok/errors.hpp"

namespace mok::mk {

namespace {

using namespace mok::gemm::engine;
using C = Cfg<256>;
namespace dev = mok::comm::dev;

// The forward's register split and slot count (forward_common.cuh): the producer decodes tickets
// and waits on counters besides issuing TMA.
constexpr int kSlots = 3;
constexpr uint32_t kProducerRegsBwd = 56, kConsumerRegsBwd = 224;

struct Slot {
  Tile tile;
  int32_t kind;
  int32_t counter;  // D2: the M tile whose counter the warpgroups release after the tile; else -1
  int32_t pad_[6];  // 64 bytes
};
static_assert(sizeof(Slot) == 64, "task slot size");
using Ring = rt::TaskRing<Slot, kSlots>;
using Cursor = rt::SlotCursor<kSlots>;
constexpr int kExtraSmem = Ring::kBytes + 16;  // the ring, then the (unused) cluster abort word
static_assert(C::kSmemBytes % 16 == 0, "task ring alignment");
static_assert(C::kSmemBytes + kExtraSmem <= 232448, "the program's shared memory exceeds 227 KB");

// The ticket order's shape from the plans; the weight gradients' experts: ExpertRange (read after
// launch: an earlier kernel on the stream wrote it).
__device__ __forceinline__ BwdGemmShape shape_of(const BwdProgramParams& P, int32_t experts) {
  BwdGemmShape s;
  s.m_tiles = P.d2.p.num_m_tiles;
  s.n_d2 = P.d2.p.n_tiles;
  s.n_d1 = P.d1.p.n_tiles;
  s.group_m = P.d2.p.group_m;
  s.experts = experts;
  s.wd_m = P.wd.p.num_m_tiles;
  s.wd_n = P.wd.p.n_tiles;
  s.w1_m = P.w1.p.num_m_tiles;
  s.w1_n = P.w1.p.n_tiles;
  s.merge = P.merge;
  return s;
}

// What the producer thread remembers between tickets, to keep global loads off its path (a
// weight-gradient tile is only a few microseconds of MMAs): the M tiles [0, ready) whose D2 tiles
// it has seen complete (a counter only grows), and the rows of the last expert it looked up.
struct ProducerMemo {
  int32_t ready = 0;
  int32_t e = -1, rows = 0, begin = 0;
};

// The engine tile of task tk; false for a routed tile of no expert (padding past the rows). WD and
// W1 read the same expert rows (the host checks it).
__device__ __forceinline__ bool make_tile(const BwdProgramParams& P, int32_t first_expert, const BwdGemmTask& tk,
                                          Tile& t, ProducerMemo& memo) {
  if (tk.kind == kGemmD2 || tk.kind == kGemmD1) {
    const bool d2 = tk.kind == kGemmD2;
    const int32_t e = __ldg((d2 ? P.d2.p.tile_expert : P.d1.p.tile_expert) + tk.m);
    if (e < 0) return false;
    t = Tile{tk.m * kBlockM, tk.n * C::kBlockN, e, 0, d2 ? P.d2.p.k_blocks : P.d1.p.k_blocks, kBlockK, tk.m * kBlockM, 0};
    return true;
  }
  const int32_t e = first_expert + tk.e;
  if (e != memo.e) {
    memo.e = e;
    memo.rows = __ldg(P.wd.p.expert_rows + e);
    memo.begin = __ldg(P.wd.p.expert_row_begin + e);
  }
  t = k_grouped_tile<C>(memo.rows, memo.begin, e, tk.m, tk.n);
  return true;
}

// Producer thread: the D2 tiles task tk reads (see backward_plan.h). False when a wait expired.
__device__ bool wait_deps(const BwdProgramParams& P, const dev::DeviceComm& dc, const BwdGemmTask& tk,
                          const Tile& t, ProducerMemo& memo) {
  const uint32_t target = 2u * uint32_t(P.d2.p.n_tiles);
  const uint32_t* done = P.counters + 1;
  const auto wait_m = [&](int32_t m) {
    if (m < memo.ready) return true;
    if (!rt::wait_counter(dc, done + m, target, rt::kWaitTaskDeps)) return false;
    if (m == memo.ready) ++memo.ready;
    return true;
  };
  if (tk.kind == kGemmD2) return true;
  if (tk.kind == kGemmD1) return wait_m(tk.m);
  // A weight-gradient tile: K runs over the expert's rows [k_begin, k_begin + rows).
  const int32_t rows = t.k_blocks == 0 ? 0 : (t.k_blocks - 1) * kBlockK + t.k_last_valid;
  const sched::TileMN range = bwd_gemm_expert_tiles(t.k_begin, rows);
  for (int32_t m = range.m; m < range.n; ++m)
    if (!wait_m(m)) return false;
  return true;
}

__device__ void producer(const BwdProgramParams& P, const dev::DeviceComm& dc, const Smem<C>& sm, const Ring& ring,
                         const WaitBound& wb) {
  const ExpertRange experts(P.wd.p);  // WD and W1 schedule the same experts
  PipeState<C> ps;
  Cursor cur;
  ProducerMemo memo;
  bool issuing = true;  // false once a wait for a free stage expired: hand out End next
  // Static weight gradients (merge 2): once the counter's tickets are gone, this CTA's own tiles.
  int64_t own = -1;  // the next of them (index among the weight-gradient tiles), -1: still dynamic
#pragma unroll 1
  for (;;) {
    BwdGemmTask tk{kGemmEnd, -1, -1, -1};
    Tile t{};
#pragma unroll 1
    while (issuing) {
      // (The shape from the parameters each time: constant-bank operands, not registers held
      // across the loop, which the producer's 56 do not have room for.)
      int64_t ticket;
      if (own < 0) {
        ticket = int64_t(atomicAdd(P.counters, 1u));
        if (P.merge == 2 && ticket >= bwd_gemm_dynamic_tickets(shape_of(P, experts.count))) own = blockIdx.x;
      }
      if (own >= 0) {
        ticket = bwd_gemm_dynamic_tickets(shape_of(P, experts.count)) + own;
        own += gridDim.x;
      }
      tk = bwd_gemm_decode(shape_of(P, experts.count), ticket);
      if (tk.kind == kGemmEnd || make_tile(P, experts.first, tk, t, memo)) break;
    }
    if (tk.kind != kGemmEnd && !wait_deps(P, dc, tk, t, memo)) tk.kind = kGemmEnd;
    // The slot (the consumers release it after the tile's epilogue); never expected to time out.
    if (!rt::handoff_wait<false>(ring.empty + cur.i, cur.phase ^ 1u, wb)) break;
    Slot& slot = ring.slot[cur.i];
    slot.tile = t;
    slot.kind = tk.kind;
    slot.counter = tk.kind == kGemmD2 ? tk.m : -1;
    mbar_arrive(ring.full + cur.i);  // release (CTA scope): the slot's contents before the arrival
    cur.advance();
    if (tk.kind == kGemmEnd) break;
    dev::fence_proxy_async();  // rows acquired from other CTAs' epilogues are read by TMA next
    switch (tk.kind) {
      case kGemmD2: issuing = produce_tile<C, false, true>(sm, ps, t, &P.d2.a, &P.d2.b, wb); break;
      case kGemmD1:  // B: the gate and up weights (two maps)
        issuing = produce_tile<C, false, true>(sm, ps, t, &P.d1.a, &P.d1.b, wb, &P.d1.b_half, false, 0u,
                                              P.d1.p.b_gate_up != 0);
        break;
      case kGemmWd: issuing = produce_tile<C, true, true>(sm, ps, t, &P.wd.a, &P.wd.b, wb); break;
      default: issuing = produce_tile<C, true, true>(sm, ps, t, &P.w1.a, &P.w1.b, wb); break;
    }
  }
  drain_stages(sm, ps, wb);
}

__device__ void consumer(const BwdProgramParams& P, const Smem<C>& sm, const Ring& ring, const WaitBound& wb) {
  const rt::ConsumerThread th;
  const int cwg = th.cwg;
  PipeState<C> ps;
  EpiState es;
  Skew<C> skew;
  float acc[C::kAccRegs];
  Cursor cur;
#pragma unroll 1
  for (;;) {
    // The warpgroup agrees on the hand-off's verdict (an expiry seen by some threads only would
    // split it at its next wgmma or barrier).
    const bool got = named_bar_and(kBarEpilogue + uint32_t(cwg), 128,
                                   rt::handoff_wait<false>(ring.full + cur.i, cur.phase, wb));
    const Slot& slot = ring.slot[cur.i];
    const int32_t kind = got ? slot.kind : int32_t(kGemmEnd);
    if (kind == kGemmEnd) break;
    const Tile& t = slot.tile;
    // Each GEMM's parameters named statically (constant bank), not through a pointer by kind.
    const auto dgrad = [&](const BwdGemm& g, auto form) {
      using Form = decltype(form);
      skew.stages = g.p.skew_stages;  // the unfused kernel's choice (the same in both warpgroups)
      mma_tile<C, false, true, false>(sm, ps, t, cwg, th.ct, acc, wb, skew);
      Form::epilogue(sm, es, t, cwg, th.wt, acc, &g.d0, &g.d1, g.p);
    };
    const auto wgrad = [&](const BwdGemm& g) {
      skew.stages = g.p.skew_stages;
      const bool accumulate = FormWgrad<C>::load_carry(t, th.ct, acc, g.p);
      mma_tile<C, true, true, true>(sm, ps, t, cwg, th.ct, acc, wb, skew, 0u, NoHook{}, accumulate);
      FormWgrad<C>::epilogue(sm, es, t, cwg, th.wt, acc, &g.d0, &g.d1, g.p);
    };
    switch (kind) {
      case kGemmD2: dgrad(P.d2, FormDgradSwiGLU<C>{}); break;
      case kGemmD1: dgrad(P.d1, FormDgrad<C>{}); break;
      case kGemmWd: wgrad(P.wd); break;
      default: wgrad(P.w1); break;
    }
    if (slot.counter >= 0) {
      // D2: this warpgroup's h stores (generic proxy) and d_gu stores (TMA) before the release
      // that D1 and weight-gradient tiles acquire before reading them with TMA.
      dev::fence_proxy_async();
      named_bar_sync(kBarEpilogue + uint32_t(cwg), 128);
      if (th.leader) {
        tma_store_wait_all<0>();
        dev::fence_proxy_async();
        rt::red_release(P.counters + 1 + slot.counter, 1u);
      }
    }
    mbar_arrive(ring.empty + cur.i);
    cur.advance();
  }
  epi_finish(th.leader);
}

__global__ void __launch_bounds__(kThreads, 1)
    backward_program(const __grid_constant__ BwdProgramParams P, const __grid_constant__ dev::DeviceComm dc) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Ring ring = Ring::at(smem_raw + C::kSmemBytes);
  const Smem<C> sm = smem_view<C>(smem_raw);
  const WaitBound wb{dc.claim, dc.timeout_ns};
  uint32_t* abort_word = reinterpret_cast<uint32_t*>(smem_raw + C::kSmemBytes + kExtraSmem - 16);
  rt::run_cta<C, kSlots, false, kProducerRegsBwd, kConsumerRegsBwd>(
      0, dc, sm, ring.full, ring.empty, abort_word, [] {}, [&] { producer(P, dc, sm, ring, wb); }, [] {},
      [&](uint32_t) { consumer(P, sm, ring, wb); });
}

}  // namespace

BwdGemm bwd_gemm_of(const gemm::Plan& plan, const char* what) {
  MOK_REQUIRE(plan.block_n == C::kBlockN && !plan.cluster, what,
              "the backward program runs 256-wide tiles without clusters (plan it with Options::block_n = 256, "
              "cluster = false), got block_n ", plan.block_n, plan.cluster ? " with clusters" : "");
  MOK_REQUIRE(plan.params.wgrad_accumulate == 0, what,
              "the backward program writes bf16 weight gradients (not WgradArgs::accumulate)");
  MOK_REQUIRE(plan.params.hold == 0, what, "the backward program carries its weight gradients (not WgradArgs::hold_*)");
  MOK_REQUIRE(plan.form != gemm::Form::DgradScatter, what,
              "the backward program stores FC1's dgrad rows densely (not plan_dgrad_scatter)");
  return BwdGemm{plan.map_a, plan.map_b, plan.map_b_half, plan.map_d0, plan.map_d1, plan.params};
}

void launch_backward_program(const BwdProgramParams& params, const comm::dev::DeviceComm& dc, int grid,
                             cudaStream_t stream) {
  const int smem = int(C::kSmemBytes) + kExtraSmem;
  static std::atomic<unsigned long long> configured{0};
  detail::set_smem_once(backward_program, smem, configured);
  MOK_REQUIRE(grid >= 1, "backward program", "grid >= 1, got ", grid);
  backward_program<<<unsigned(grid), kThreads, size_t(smem), stream>>>(params, dc);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::mk
