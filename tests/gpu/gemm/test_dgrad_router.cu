// FC2's dgrad + SwiGLU' over unweighted rows with their router weights
// (gemm::DgradSwiGLUArgs::row_weight / router_partial: the layer's backward since the router-weight
// gradient is <d_out . W_down, h>, include/mok/reference.hpp):
//   - with every weight 1, d_gu has the bits of the plain (weighted-rows) form;
//   - with weights (0 among them), every d_gu element is within one bf16 step of the formula on the
//     host from plan_dgrad's bits of g = rnd(d . W_down): d_h = rnd(w * g) (the SFU's exp and
//     division are the only difference);
//   - h = rnd(silu(g) * u) of the gate/up rows, computed in the epilogue with FC1's bits (a kernel
//     here runs swiglu_math.cuh's definition; it is checked against the host's formula too), and
//     h is written rnd(w * h), bitwise (dW_down's operand; the buffer's old contents never read);
//   - each row's partial sums, summed in order, are within 1e-5 of <g, h> on the host (in fp64)
//     relative to sum |g h|, and they are the same bits at tile widths 128 and 256 and with 2-CTA
//     clusters (sums of 64 columns, whatever the tile);
//   - two runs give the same bits; padding rows (NaN in d and gu) write nothing the checks read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "gemm/swiglu_math.cuh"
#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "mok/workload.hpp"

namespace {

using namespace mok::test;
namespace gemm = mok::gemm;

// h = rnd(silu(g) * u) of every row of the packed gate/up rows gu [rows, 2I], one thread per element:
// FC1's epilogue's definition (gemm/swiglu_math.cuh), the bits the dgrad epilogue must compute.
__global__ void swiglu_reference(const uint16_t* gu, uint16_t* h, int64_t rows, int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = __uint_as_float(uint32_t(gu[r * 2 * inter + gemm::packed_gate_row(c)]) << 16);
    const float u = __uint_as_float(uint32_t(gu[r * 2 * inter + gemm::packed_up_row(c)]) << 16);
    h[i] = __bfloat16_as_ushort(__float2bfloat16_rn(gemm::swiglu_of_bf16(g, u)));
  }
}

struct Outputs {
  std::vector<uint16_t> d_gu, h;
  std::vector<float> partial;
};

struct Case {
  Routed rt;
  int64_t hidden, inter;
  std::vector<uint16_t> d, w, gu, h;  // h: swiglu_reference of gu
  std::vector<float> weight;
  DevBuf dd, dw, dte, dweight;
  Case(const std::vector<int32_t>& counts, int64_t H, int64_t I, uint64_t seed)
      : rt(counts), hidden(H), inter(I), d(routed_input(rt, H, seed)),
        w(random_bf16(size_t(int64_t(counts.size()) * H * I), seed + 1, 0.05)), gu(routed_input(rt, 2 * I, seed + 2)),
        dd(d.size() * 2), dw(w.size() * 2), dte(rt.tile_expert.size() * 4 + 4), dweight(size_t(rt.rows) * 4) {
    mok::Rng rng(seed + 3);  // the workload generator's
    weight.resize(size_t(rt.rows));
    for (int64_t r = 0; r < rt.rows; ++r) {
      const double u = rng.uniform();
      weight[size_t(r)] = rt.expert_of(r) < 0 ? 0.0f : (u < 0.1 ? 0.0f : float(u));  // some zero weights
    }
    upload(dd, d);
    upload(dw, w);
    upload(dte, rt.tile_expert);
    DevBuf dgu(gu.size() * 2), dh(size_t(rt.rows * I) * 2);
    upload(dgu, gu);
    swiglu_reference<<<256, 256>>>(dgu.as<uint16_t>(), dh.as<uint16_t>(), rt.rows, I);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    h = download<uint16_t>(dh, size_t(rt.rows * I));
  }
  // One run (poisoned outputs) with the given weights (nullptr: the plain form); block_n, clusters.
  Outputs run(const std::vector<float>* weights, int block_n, bool cluster, const gemm::RowPull* pull = nullptr) {
    const int64_t rows = rt.rows, n2 = 2 * inter, parts = gemm::router_parts(inter);
    DevBuf dgu(gu.size() * 2), dout(size_t(rows * n2) * 2), dpart(size_t(rows * parts) * 4 + 4), err(4),
        dh(h.size() * 2);
    upload(dgu, gu);
    EXPECT_EQ(cudaSuccess, cudaMemset(dh.p, 0xFF, dh.bytes));  // NaN: written, never read
    EXPECT_EQ(cudaSuccess, cudaMemset(dout.p, 0xFF, dout.bytes));
    EXPECT_EQ(cudaSuccess, cudaMemset(dpart.p, 0xFF, dpart.bytes));
    EXPECT_EQ(cudaSuccess, cudaMemset(err.p, 0, 4));
    gemm::DgradSwiGLUArgs a{.dy = dd.p, .w_down = dw.p, .gu = dgu.p, .d_gu = dout.p, .hidden = hidden,
                            .inter = inter, .experts = int64_t(rt.counts.size()), .tile_expert = dte.as<int32_t>(),
                            .num_m_tiles = rt.num_m_tiles()};
    if (weights != nullptr) {
      upload(dweight, *weights);
      a.row_weight = dweight.as<float>();
      a.router_partial = dpart.as<float>();
      a.h = dh.p;
    }
    if (pull != nullptr) a.pull = *pull;
    gemm::Options o;
    o.block_n = block_n;
    o.cluster = cluster;
    o.error = err.as<unsigned>();
    o.wait_limit_s = 5.0;
    const gemm::Plan plan = gemm::plan_dgrad_swiglu(a, o);
    EXPECT_EQ(plan.block_n, block_n);
    gemm::run(plan, nullptr);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(download<unsigned>(err, 1)[0], 0u) << "a bounded wait expired";
    Outputs out{download<uint16_t>(dout, size_t(rows * n2)), {}, {}};
    if (weights != nullptr) {
      out.partial = download<float>(dpart, size_t(rows * parts));
      out.h = download<uint16_t>(dh, h.size());
    }
    return out;
  }
  // g = rnd(d . W_down) of every row, as plan_dgrad computes it (the unweighted d_h).
  std::vector<uint16_t> unweighted_dh() {
    DevBuf ddh(size_t(rt.rows * inter) * 2);
    const gemm::DgradArgs g{.dy = dd.p, .w = dw.p, .dx = ddh.p, .k = hidden, .n = inter,
                            .experts = int64_t(rt.counts.size()), .tile_expert = dte.as<int32_t>(),
                            .num_m_tiles = rt.num_m_tiles()};
    gemm::run(gemm::plan_dgrad(g, {}), nullptr);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return download<uint16_t>(ddh, size_t(rt.rows * inter));
  }
};

void check_case(const std::vector<int32_t>& counts, int64_t H, int64_t I, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "H=" << H << " I=" << I);
  Case c(counts, H, I, seed);
  const int64_t rows = c.rt.rows, n2 = 2 * I, parts = gemm::router_parts(I);
  const std::vector<float> ones(size_t(rows), 1.0f);
  // Weight 1: the plain form's bits.
  const Outputs plain = c.run(nullptr, 256, false), unit = c.run(&ones, 256, false);
  const Outputs first = c.run(&c.weight, 256, false), again = c.run(&c.weight, 256, false);
  const Outputs narrow = c.run(&c.weight, 128, false), paired = c.run(&c.weight, 256, true);
  const auto g = c.unweighted_dh();
  int64_t unit_diff = 0, far = 0, rerun_diff = 0, width_diff = 0, compared = 0, h_diff = 0, h_far = 0;
  double rel_max = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (c.rt.expert_of(r) < 0) continue;
    const float wr = c.weight[size_t(r)];
    double dot = 0, mag = 0;
    for (int64_t i = 0; i < I; ++i) {
      const size_t pg = size_t(r * n2 + gemm::packed_gate_row(i)), pu = size_t(r * n2 + gemm::packed_up_row(i));
      unit_diff += (unit.d_gu[pg] != plain.d_gu[pg]) + (unit.d_gu[pu] != plain.d_gu[pu]);
      rerun_diff += (again.d_gu[pg] != first.d_gu[pg]) + (again.d_gu[pu] != first.d_gu[pu]);
      const float gd = float_of(g[size_t(r * I + i)]), gf = float_of(c.gu[pg]), uf = float_of(c.gu[pu]);
      const float dh = float_of(bits_of(wr * gd)), sf = 1.0f / (1.0f + std::exp(-gf));
      far += (bf16_steps_apart(first.d_gu[pg], bits_of(sf * (1.0f + gf * (1.0f - sf)) * uf * dh)) > 1) +
             (bf16_steps_apart(first.d_gu[pu], bits_of(gf * sf * dh)) > 1);
      compared += 2;
      const size_t hi = size_t(r * I + i);
      const float hf = float_of(c.h[hi]);
      h_far += bf16_steps_apart(c.h[hi], bits_of(gf / (1.0f + std::exp(-gf)) * uf)) > 1;
      dot += double(gd) * double(hf);
      mag += std::fabs(double(gd) * double(hf));
      h_diff += first.h[hi] != bits_of(wr * hf);
      width_diff += (narrow.h[hi] != first.h[hi]) + (paired.h[hi] != first.h[hi]) + (again.h[hi] != first.h[hi]);
    }
    float sum = 0.0f;
    for (int64_t q = 0; q < parts; ++q) {
      const size_t at = size_t(r * parts + q);
      sum += first.partial[at];
      width_diff += std::memcmp(&first.partial[at], &narrow.partial[at], 4) != 0;
      width_diff += std::memcmp(&first.partial[at], &paired.partial[at], 4) != 0;
      rerun_diff += std::memcmp(&first.partial[at], &again.partial[at], 4) != 0;
    }
    ASSERT_TRUE(std::isfinite(sum)) << "row " << r << ": unwritten or NaN partial sums";
    rel_max = std::max(rel_max, std::fabs(double(sum) - dot) / std::max(1e-6, mag));
  }
  EXPECT_EQ(unit_diff, 0) << "weight 1 changed d_gu's bits";
  EXPECT_EQ(far, 0) << "of " << compared << " d_gu elements more than one bf16 step from rnd(w * g)'s formula";
  EXPECT_EQ(rerun_diff, 0) << "a second run gave other bits";
  EXPECT_EQ(width_diff, 0) << "the partial sums or h depend on the tile width, clusters or the run";
  EXPECT_LE(rel_max, 1e-5) << "router-weight gradient vs <g, h> on the host (relative to sum |g h|)";
  EXPECT_EQ(h_far, 0) << "the reference h is more than a bf16 step from the host's silu(g) * u";
  EXPECT_EQ(h_diff, 0) << "h not written rnd(w * rnd(silu(g) * u)) with FC1's bits";
  std::printf("[dgrad router] rows=%lld H=%lld I=%lld: d_gu within a step (%lld), <g,h> rel max %.1e\n",
              (long long)rows, (long long)H, (long long)I, (long long)compared, rel_max);
}

// I = 160 (a 64-column group cut at 32: the last sum holds half a group) and 512; experts with
// 0, 1, 63, 128, 200 and 385 rows; K = 328 not a multiple of 64.
TEST(DgradSwiGLURouter, UnweightedRowsWithTheirWeights) {
  MOK_REQUIRE_GPUS(1);
  check_case({0, 1, 63, 128, 200, 385}, 328, 160, 901);
  check_case({512, 300, 0, 1000, 17}, 1024, 512, 902);
}

// Rows pulled beside the GEMM by its idle producer warps (gemm::RowPull, the backward's x rows):
// rows [row_begin, min(row_end, *total_rows)) of the tables land window-relative in `to`, each the
// token's row (slot / top_k) of its rank's window, zeros for padding rows (rank -1), nothing past
// the end, nothing at all once the abort word is set; d_gu keeps the bits of the call without.
// Both tile widths and 2-CTA clusters (the pull runs in every CTA's producer warps).
TEST(DgradSwiGLURouter, PulledRowsAreTheDispatchPullsRows) {
  MOK_REQUIRE_GPUS(1);
  Case c({300, 1, 0, 129, 640}, 256, 128, 911);
  const Outputs plain = c.run(nullptr, 256, false);
  constexpr int kRanks = 3;
  constexpr int64_t kTokens = 200, kTopK = 4, kN = 392;  // (49 vectors a row: not a multiple of 64)
  const int64_t table_rows = 5000, row_begin = 1280;
  std::vector<std::vector<uint16_t>> windows;
  std::vector<std::unique_ptr<DevBuf>> wbufs;
  std::vector<void*> wptr;
  for (int r = 0; r < kRanks; ++r) {
    windows.push_back(random_bf16(size_t(kTokens * kN), 920 + uint64_t(r)));
    wbufs.push_back(std::make_unique<DevBuf>(windows.back().size() * 2));
    upload(*wbufs.back(), windows.back());
    wptr.push_back(wbufs.back()->p);
  }
  mok::Rng rng(930);
  std::vector<int32_t> rank(static_cast<size_t>(table_rows)), slot(static_cast<size_t>(table_rows));
  for (int64_t g = 0; g < table_rows; ++g) {
    rank[size_t(g)] = rng.uniform() < 0.1 ? -1 : int32_t(rng.next() % kRanks);
    slot[size_t(g)] = int32_t(rng.next() % (kTokens * kTopK));
  }
  DevBuf drank(rank.size() * 4), dslot(slot.size() * 4), dfrom(kRanks * 8), dtotal(4), dabort(4);
  upload(drank, rank);
  upload(dslot, slot);
  upload(dfrom, wptr);
  const auto pulled = [&](int32_t total, int64_t row_end, uint32_t abort, int block_n, bool cluster) {
    upload(dtotal, std::vector<int32_t>{total});
    upload(dabort, std::vector<uint32_t>{abort});
    const int64_t span = 3000;
    DevBuf to(size_t(span * kN) * 2);
    EXPECT_EQ(cudaSuccess, cudaMemset(to.p, 0x7F, to.bytes));  // poison: left where nothing is pulled
    gemm::RowPull pull;
    pull.src_rank = drank.as<int32_t>();
    pull.src_slot = dslot.as<int32_t>();
    pull.total_rows = dtotal.as<int32_t>();
    pull.from = reinterpret_cast<const void* const*>(dfrom.p);
    pull.to = to.p;
    pull.row_begin = row_begin;
    pull.row_end = row_end;
    pull.n = kN;
    pull.top_k = kTopK;
    pull.abort = dabort.as<uint32_t>();
    const Outputs out = c.run(nullptr, block_n, cluster, &pull);
    EXPECT_EQ(out.d_gu, plain.d_gu) << "the pull changed d_gu's bits";
    const std::vector<uint16_t> got = download<uint16_t>(to, size_t(span * kN));
    const int64_t end = std::min<int64_t>(row_end < 0 ? total : row_end, total);
    int64_t wrong = 0;
    for (int64_t l = 0; l < span; ++l) {
      const int64_t g = row_begin + l;
      for (int64_t i = 0; i < kN; ++i) {
        uint16_t want = 0x7F7F;  // (untouched)
        if (abort == 0 && g < end)
          want = rank[size_t(g)] < 0 ? uint16_t(0)
                                     : windows[size_t(rank[size_t(g)])][size_t((slot[size_t(g)] / kTopK) * kN + i)];
        wrong += got[size_t(l * kN + i)] != want;
      }
    }
    return wrong;
  };
  for (const auto& [bn, cl] : {std::pair{256, false}, std::pair{128, false}, std::pair{256, true}}) {
    SCOPED_TRACE(testing::Message() << "block_n " << bn << (cl ? ", clusters" : ""));
    EXPECT_EQ(pulled(4000, -1, 0, bn, cl), 0) << "to the schedule's rows";
    EXPECT_EQ(pulled(4000, 2500, 0, bn, cl), 0) << "to row_end";
    EXPECT_EQ(pulled(1000, -1, 0, bn, cl), 0) << "no rows (total before row_begin)";
  }
  EXPECT_EQ(pulled(4000, -1, 1, 256, false), 0) << "after an abort";
}

// row_weight without router_partial and h is named.
TEST(DgradSwiGLURouter, WeightsAndPartialsComeTogether) {
  MOK_REQUIRE_GPUS(1);
  DevBuf buf(1 << 20), te(64);
  float f = 0;
  gemm::DgradSwiGLUArgs a{.dy = buf.p, .w_down = buf.p, .gu = buf.p, .d_gu = buf.p, .hidden = 64, .inter = 64,
                          .experts = 1, .tile_expert = te.as<int32_t>(), .num_m_tiles = 1};
  a.row_weight = &f;
  try {
    (void)gemm::plan_dgrad_swiglu(a, {});
    ADD_FAILURE() << "row_weight without router_partial and h accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "dgrad_swiglu.row_weight") << e.what();
  }
}

// The rows pulled beside the GEMM (gemm::RowPull, the backward's x rows) are checked by name: the
// tables with `to`, whole 16-byte vectors, a row window, an aligned destination. (Their bits are
// the layer's: LayerBackwardWindows with MOK_BWD_X_BESIDE=1 against the unfused backward.)
TEST(DgradSwiGLURouter, PulledRowsArgumentsAreNamed) {
  MOK_REQUIRE_GPUS(1);
  DevBuf buf(1 << 20), te(64);
  const auto plan_with = [&](const gemm::RowPull& pull) {
    gemm::DgradSwiGLUArgs a{.dy = buf.p, .w_down = buf.p, .gu = buf.p, .d_gu = buf.p, .hidden = 64, .inter = 64,
                            .experts = 1, .tile_expert = te.as<int32_t>(), .num_m_tiles = 1};
    a.pull = pull;
    (void)gemm::plan_dgrad_swiglu(a, {});
  };
  gemm::RowPull ok;
  ok.src_rank = ok.src_slot = ok.total_rows = te.as<int32_t>();
  ok.from = reinterpret_cast<const void* const*>(buf.p);
  ok.to = buf.p;
  ok.n = 64;
  plan_with(ok);  // (accepted)
  const auto refused = [&](gemm::RowPull p, const char* argument) {
    try {
      plan_with(p);
      ADD_FAILURE() << "accepted a pull that " << argument << " refuses";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  gemm::RowPull p = ok;
  p.from = nullptr;
  refused(p, "dgrad_swiglu.pull");
  p = ok;
  p.n = 12;
  refused(p, "dgrad_swiglu.pull.n");
  p = ok;
  p.row_begin = 256;
  p.row_end = 128;
  refused(p, "dgrad_swiglu.pull.row_begin");
  p = ok;
  p.to = static_cast<char*>(buf.p) + 8;
  refused(p, "dgrad_swiglu.pull.to");
}

}  // namespace
