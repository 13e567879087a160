// A weight gradient whose rows come in several calls (WgradArgs::carry_in / carry_out: the
// backward's macrobatches, notes/memory.md) gives the bits of one call over all rows: the routed
// layout is cut into windows of whole 128-row tiles, each call gets every expert's token rows
// inside its window, the expert cut by a window's end continues through the fp32 carry (two
// buffers, alternating: a call reads one while it writes the other), and experts
// without rows in a call are left to the call that has them (expert_rows_total). Cuts inside an
// expert, an expert spanning three windows (carry in and out of the same call), empty experts, a
// partial N tile; both tile widths, with and without 2-CTA clusters, the gate/up split store.
// With held rows (WgradArgs::hold_*, the layer's bf16 windows: schedule_math.h's window_ends) an
// expert cut by a window's end that fits the hold is run by the next call instead, over the rows
// held for it and its own: the same bits again.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <vector>

#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "schedule/schedule_math.h"

namespace {

using namespace mok::test;
namespace gemm = mok::gemm;
namespace sched = mok::sched;

struct Variant {
  int block_n = 0;
  bool cluster = false;
  bool gate_up = false;  // dw_up given: m is a packed gate/up width
  bool accumulate = false;  // WgradArgs::accumulate: fp32 dw from zeros (returned as its raw halves)
};

// One wgrad over rows [0, rows) of the routed layout, or over the windows `cuts` (row offsets,
// multiples of 128, ascending, ending at rows) with the carry. Returns dw (and dw_up).
std::vector<uint16_t> wgrad_in_windows(const Routed& rt, const DevBuf& a, const DevBuf& b, int64_t m, int64_t n,
                                       const Variant& v, const std::vector<int64_t>& cuts) {
  const int64_t E = int64_t(rt.counts.size());
  const size_t out = size_t(E * m * n);
  const size_t carry_floats = size_t(gemm::wgrad_carry_floats(m, n));
  const size_t elem = v.accumulate ? 4 : 2;
  DevBuf dw(out * elem), err(4), carry(carry_floats * 2 * 4), total(size_t(E) * 4 + 4),
      beg(size_t(E) * 4 + 4), cnt(size_t(E) * 4 + 4), ce(8);
  // bf16: NaN poison (every element is written once); accumulate: zeros (every element is added to once).
  EXPECT_EQ(cudaSuccess, cudaMemset(dw.p, v.accumulate ? 0 : 0xFF, dw.bytes));
  EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
  upload(total, rt.counts);
  gemm::Options o;
  o.error = err.as<unsigned>();
  o.block_n = v.block_n;
  o.cluster = v.cluster;
  int64_t lo = 0;
  int32_t carried = -1;  // the expert whose sums the previous window left in the carry
  int slot = 0;          // which half of `carry` the previous window wrote (this one reads it)
  for (const int64_t hi : cuts) {
    std::vector<int32_t> b0(static_cast<size_t>(E)), c0(static_cast<size_t>(E));
    int32_t out_e = -1;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = rt.begin[size_t(e)], t = s + rt.counts[size_t(e)];
      const int64_t ps = std::max(s, lo), pt = std::min(t, hi);
      b0[size_t(e)] = int32_t(ps);
      c0[size_t(e)] = int32_t(std::max<int64_t>(0, pt - ps));
      if (ps < pt && pt < t) out_e = int32_t(e);  // its rows go on past this window
    }
    upload(beg, b0);
    upload(cnt, c0);
    upload(ce, std::vector<int32_t>{carried, out_e});
    gemm::WgradArgs w;
    w.a = a.p;
    w.b = b.p;
    w.dw = dw.p;
    w.m = m;
    w.n = n;
    w.experts = E;
    w.rows_total = rt.rows;
    w.expert_row_begin = beg.as<int32_t>();
    w.expert_rows = cnt.as<int32_t>();
    if (v.gate_up) w.dw_up = static_cast<char*>(dw.p) + out / 2 * elem;
    w.accumulate = v.accumulate;
    if (cuts.size() > 1) {
      w.carry_in = carry.as<float>() + size_t(slot) * carry_floats;
      w.carry_out = carry.as<float>() + size_t(slot ^ 1) * carry_floats;
      w.carry_experts = ce.as<int32_t>();
      w.expert_rows_total = total.as<int32_t>();
    }
    gemm::run(gemm::plan_wgrad(w, o), nullptr);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());  // the per-call arrays are refilled next
    carried = out_e;
    slot ^= 1;
    lo = hi;
  }
  EXPECT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  return download<uint16_t>(dw, out * elem / 2);
}

void carry_case(const std::vector<int32_t>& counts, int64_t m, int64_t n, const std::vector<int64_t>& tile_cuts,
                const Variant& v, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "wgrad carry m=" << m << " n=" << n << " bn=" << v.block_n
                                  << " cluster=" << v.cluster << " gate_up=" << v.gate_up
                                  << " accumulate=" << v.accumulate);
  const Routed rt(counts);
  const auto a = routed_input(rt, m, seed), b = routed_input(rt, n, seed + 1);  // padding rows NaN
  DevBuf da(a.size() * 2), db(b.size() * 2);
  upload(da, a);
  upload(db, b);
  std::vector<int64_t> cuts;
  for (const int64_t t : tile_cuts) cuts.push_back(t * 128);
  cuts.push_back(rt.rows);
  const auto one = wgrad_in_windows(rt, da, db, m, n, v, {rt.rows});
  const auto split = wgrad_in_windows(rt, da, db, m, n, v, cuts);
  int64_t differ = 0, nonfinite = 0;
  for (size_t i = 0; i < one.size(); ++i) differ += one[i] != split[i];
  if (v.accumulate) {
    for (size_t i = 0; i + 1 < one.size(); i += 2) {
      float f;
      std::memcpy(&f, &one[i], 4);
      nonfinite += !std::isfinite(f);
    }
  } else {
    for (const uint16_t b : one) nonfinite += !std::isfinite(float_of(b));
  }
  EXPECT_EQ(nonfinite, 0) << "the one-call gradient has unwritten or NaN elements";
  EXPECT_EQ(differ, 0) << "of " << one.size() << " elements, split into " << cuts.size() << " calls";
  std::printf("[wgrad carry] E=%zu m=%lld n=%lld calls=%zu bn=%d cluster=%d gate_up=%d: %lld of %zu differ\n",
              counts.size(), (long long)m, (long long)n, cuts.size(), v.block_n, v.cluster, v.gate_up,
              (long long)differ, one.size());
}

// The calls over windows [lo, hi) as the layer makes them with held rows: window-relative rows,
// window_ends' carried, owned and held experts; B's held rows copied after the call to the end of
// a hold buffer of hold_rows rows (the layer's x, d_y and h rows), A's read where they are (a's
// rows before lo: the layer's saved d_gu) or, copy_a, copied too (dW_down's d_y). *held: the cuts
// held.
std::vector<uint16_t> wgrad_held(const Routed& rt, const DevBuf& a, const DevBuf& b, int64_t m, int64_t n,
                                 const Variant& v, const std::vector<int64_t>& cuts, int64_t hold_rows, bool copy_a,
                                 int* held) {
  const int32_t E = int32_t(rt.counts.size());
  const size_t out = size_t(E * m * n), carry_floats = size_t(gemm::wgrad_carry_floats(m, n));
  const size_t elem = v.accumulate ? 4 : 2;
  DevBuf dw(out * elem), err(4), carry(carry_floats * 2 * 4), total(size_t(E) * 4 + 4), beg(size_t(E) * 4 + 4),
      cnt(size_t(E) * 4 + 4), ce(8), range(8), hb(size_t(hold_rows * n) * 2), ha(size_t(hold_rows * m) * 2);
  EXPECT_EQ(cudaSuccess, cudaMemset(dw.p, v.accumulate ? 0 : 0xFF, dw.bytes));
  EXPECT_EQ(cudaSuccess, cudaMemset(hb.p, 0xFF, hb.bytes));  // NaN: a hold row read but not held shows
  EXPECT_EQ(cudaSuccess, cudaMemset(ha.p, 0xFF, ha.bytes));
  EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
  upload(total, rt.counts);
  gemm::Options o;
  o.error = err.as<unsigned>();
  o.block_n = v.block_n;
  int64_t lo = 0, prev_lo = 0;
  int slot = 0;
  for (const int64_t hi : cuts) {
    const sched::WindowEnds w = sched::window_ends(rt.begin.data(), rt.counts.data(), E, lo, hi, hi == rt.rows,
                                                   sched::WindowHold{hold_rows, prev_lo, rt.rows});
    std::vector<int32_t> b0(static_cast<size_t>(E)), c0(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) {
      const sched::WindowPart p = sched::window_part(rt.begin[size_t(e)], rt.counts[size_t(e)], lo, hi);
      b0[size_t(e)] = p.begin - (e == w.held_in ? w.held_in_rows : 0);
      c0[size_t(e)] = p.rows + (e == w.held_in ? w.held_in_rows : 0);
    }
    upload(beg, b0);
    upload(cnt, c0);
    upload(ce, std::vector<int32_t>{w.carry_in, w.carry_out});
    upload(range, std::vector<int32_t>{w.first, w.owned});
    gemm::WgradArgs g;
    g.a = static_cast<const char*>(a.p) + lo * m * 2;
    g.b = static_cast<const char*>(b.p) + lo * n * 2;
    g.dw = dw.p;
    g.m = m;
    g.n = n;
    g.experts = E;
    g.rows_total = hi - lo;
    g.expert_row_begin = beg.as<int32_t>();
    g.expert_rows = cnt.as<int32_t>();
    if (v.gate_up) g.dw_up = static_cast<char*>(dw.p) + out / 2 * elem;
    g.accumulate = v.accumulate;
    g.carry_in = carry.as<float>() + size_t(slot) * carry_floats;
    g.carry_out = carry.as<float>() + size_t(slot ^ 1) * carry_floats;
    g.carry_experts = ce.as<int32_t>();
    g.expert_rows_total = total.as<int32_t>();
    g.expert_range = range.as<int32_t>();
    if (lo > 0) {
      g.hold_a = copy_a ? ha.p : a.p;
      g.hold_a_rows = copy_a ? hold_rows : rt.rows;
      g.hold_a_row = copy_a ? hold_rows : lo;
      g.hold_b = hb.p;
      g.hold_b_rows = g.hold_b_row = hold_rows;
    }
    gemm::run(gemm::plan_wgrad(g, o), nullptr);
    if (w.held_out >= 0) {  // (after the call, as the layer's copy: rows [at, at + held) of the window)
      ++*held;
      EXPECT_EQ(cudaSuccess, cudaMemcpy(static_cast<char*>(hb.p) + (hold_rows - w.held_out_rows) * n * 2,
                                        static_cast<const char*>(b.p) + (lo + w.held_out_at) * n * 2,
                                        size_t(w.held_out_rows * n * 2), cudaMemcpyDeviceToDevice));
      if (copy_a)
        EXPECT_EQ(cudaSuccess, cudaMemcpy(static_cast<char*>(ha.p) + (hold_rows - w.held_out_rows) * m * 2,
                                          static_cast<const char*>(a.p) + (lo + w.held_out_at) * m * 2,
                                          size_t(w.held_out_rows * m * 2), cudaMemcpyDeviceToDevice));
    }
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    slot ^= 1;
    prev_lo = lo;
    lo = hi;
  }
  EXPECT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
  return download<uint16_t>(dw, out * elem / 2);
}

TEST(WgradCarry, HeldRowsGiveTheOneCallBits) {
  MOK_REQUIRE_GPUS(1);
  // Tiles per expert 3, 0, 6, 2, 1, 8: cuts at tiles 2 (inside expert 0: held, 256 rows), 4 and 7
  // (expert 2 spans three windows: its first 128 rows held, then carried out of the window that
  // holds them in), 10 (inside expert 3: held, 128 rows), 15 (inside expert 5: 384 rows, held
  // with a hold of 384, carried with 256): 3 or 4 cuts held.
  const std::vector<int32_t> counts = {300, 0, 700, 129, 64, 1000};
  const Routed rt(counts);
  std::vector<int64_t> cuts;
  for (const int64_t t : {2, 4, 7, 10, 15}) cuts.push_back(t * 128);
  cuts.push_back(rt.rows);
  for (const Variant& v : {Variant{256, false, false}, Variant{128, false, false}, Variant{256, false, true},
                           Variant{256, false, true, true}})
    for (const int64_t hold_rows : {int64_t(256), int64_t(384)}) {
      const bool copy_a = hold_rows == 384;  // (A read in place with 256, copied with 384)
      SCOPED_TRACE(testing::Message() << "held rows bn=" << v.block_n << " gate_up=" << v.gate_up
                                      << " accumulate=" << v.accumulate << " hold=" << hold_rows
                                      << " copy_a=" << copy_a);
      const int64_t m = 192, n = 328;
      const auto a = routed_input(rt, m, 1301), b = routed_input(rt, n, 1302);
      DevBuf da(a.size() * 2), db(b.size() * 2);
      upload(da, a);
      upload(db, b);
      int held = 0;
      const auto one = wgrad_in_windows(rt, da, db, m, n, v, {rt.rows});
      const auto split = wgrad_held(rt, da, db, m, n, v, cuts, hold_rows, copy_a, &held);
      int64_t differ = 0;
      for (size_t i = 0; i < one.size(); ++i) differ += one[i] != split[i];
      EXPECT_EQ(held, hold_rows == 256 ? 3 : 4) << "cuts held";
      EXPECT_EQ(differ, 0) << "of " << one.size() << " elements";
      std::printf("[wgrad held] bn=%d gate_up=%d accumulate=%d hold=%lld: %d cuts held, %lld of %zu differ\n",
                  v.block_n, v.gate_up, v.accumulate, (long long)hold_rows, held, (long long)differ, one.size());
    }
  // Refused: held rows with clusters, a hold row that is not a whole tile.
  gemm::WgradArgs g;
  DevBuf x(size_t(256 * 64) * 2), rows(8), dw(size_t(64 * 64) * 2);
  g.a = g.b = x.p;
  g.dw = dw.p;
  g.m = g.n = 64;
  g.experts = 1;
  g.rows_total = 256;
  g.expert_row_begin = g.expert_rows = rows.as<int32_t>();
  g.hold_a = g.hold_b = x.p;
  g.hold_a_rows = g.hold_b_rows = 256;
  g.hold_a_row = g.hold_b_row = 128;
  gemm::Options c;
  c.cluster = true;
  EXPECT_THROW(gemm::plan_wgrad(g, c), mok::Error);
  g.hold_b_row = 200;
  EXPECT_THROW(gemm::plan_wgrad(g, gemm::Options{}), mok::Error);
  // An expert starting more rows before the call's than the hold has: not computed, and recorded.
  upload(rows, std::vector<int32_t>{-256, 384});  // {begin, rows}
  g.expert_rows = rows.as<int32_t>() + 1;
  DevBuf err(4);
  EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
  gemm::Options o;
  o.error = err.as<unsigned>();
  g.hold_b_row = 128;
  gemm::run(gemm::plan_wgrad(g, o), nullptr);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  EXPECT_EQ(download<unsigned>(err, 1)[0], gemm::kSiteHeldRows);
}

TEST(WgradCarry, CallsOverWindowsGiveTheOneCallBits) {
  MOK_REQUIRE_GPUS(1);
  // Tiles per expert: 3, 0, 6, 2, 1 (rows 300, 0, 700, 129, 64): cuts at tiles 2 (inside expert 0),
  // 4 and 7 (expert 2 spans three windows), 10 (inside expert 3).
  const std::vector<int32_t> counts = {300, 0, 700, 129, 64};
  const std::vector<int64_t> cuts = {2, 4, 7, 10};
  for (const Variant& v : {Variant{256, false, false}, Variant{128, false, false}, Variant{256, true, false},
                           Variant{256, false, true}, Variant{256, false, false, true},
                           Variant{128, false, true, true}})
    carry_case(counts, 192, 328, cuts, v, 1201);
  carry_case({1000}, 256, 512, {1, 3, 5, 6}, Variant{256, true, true}, 1202);  // one expert, five calls
}

}  // namespace
