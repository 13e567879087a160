// The frame the grouped GEMM form tests run their cases in, shared by test_grouped_gemm.cu (the
// plain forms and the tile options across them) and test_grouped_gemm_variants.cu (the forms that
// extend a plain one): the tolerance, the tile options a case runs with, the bounded waits' error
// flag, the two-run bitwise check, and a weight gradient's operands (both files' wgrad cases).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gemm_test_util.h"
#include "mok/gemm.hpp"

namespace mok::test::grouped {

constexpr double kTol = 1e-2;
// Tile width the cases run with (tests set it; 256 unless a test says otherwise). Inline
// variables: one of each in the test binary, which both files' tests set and their cases read.
inline int g_block_n = 256;
inline bool g_cluster = false;  // 2-CTA clusters with B multicast
inline bool g_group_experts = false;  // raster groups split at experts (Options::group_experts)

// A case's gemm::Options (tile width, stagger, clusters, expert-split raster groups) and the flag its bounded waits raise when
// one expires, cleared for each plan.
struct Device {
  DevBuf err{sizeof(unsigned)};
  int skew = 0;
  int block_n = 256;
  gemm::Options opts(int max_ctas) {
    cudaMemset(err.p, 0, sizeof(unsigned));
    gemm::Options o;
    o.max_ctas = max_ctas;
    o.skew_stages = skew;
    o.block_n = block_n;
    o.cluster = g_cluster;
    o.group_experts = g_group_experts;
    o.error = err.as<unsigned>();
    o.wait_limit_s = 5.0;
    return o;
  }
  unsigned error() { return download<unsigned>(err, 1)[0]; }
};

inline void poison(DevBuf& d) { ASSERT_EQ(cudaSuccess, cudaMemset(d.p, 0xFF, d.bytes)); }

// Runs a plan twice (poisoning before each run) and returns the outputs of both runs.
template <typename Outs>
void run_twice(const gemm::Plan& plan, Device& dev, Outs&& outs, std::vector<std::vector<uint16_t>>& first,
               std::vector<std::vector<uint16_t>>& second) {
  for (int rep = 0; rep < 2; ++rep) {
    for (DevBuf* o : outs) poison(*o);
    gemm::run(plan, nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
    auto& dst = rep == 0 ? first : second;
    dst.clear();
    for (DevBuf* o : outs) dst.push_back(download<uint16_t>(*o, o->bytes / 2));
  }
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(first[i] == second[i]) << "output " << i << " differs between runs";
}

// A weight gradient's operands on the device: a [rows, m] and b [rows, n] over the routed layout
// of `counts` (padding rows NaN: the K mask must drop them), the experts' rows, and its args
// (without outputs).
struct WgradProblem {
  Routed rt;
  int64_t E;
  std::vector<uint16_t> a, b;
  DevBuf da, db, dbeg, dcnt;
  gemm::WgradArgs g;
  WgradProblem(const std::vector<int32_t>& counts, int64_t m, int64_t n, uint64_t seed)
      : rt(counts), E(int64_t(counts.size())), a(routed_input(rt, m, seed)), b(routed_input(rt, n, seed + 1)),
        da(a.size() * 2), db(b.size() * 2), dbeg(size_t(E) * 4), dcnt(size_t(E) * 4) {
    upload(da, a);
    upload(db, b);
    upload(dbeg, rt.begin);
    upload(dcnt, rt.counts);
    g.a = da.p;
    g.b = db.p;
    g.m = m;
    g.n = n;
    g.experts = E;
    g.rows_total = rt.rows;
    g.expert_row_begin = dbeg.as<int32_t>();
    g.expert_rows = dcnt.as<int32_t>();
  }
};

}  // namespace mok::test::grouped
