// FC1's dgrad with the reverse dispatch in its epilogue (gemm::plan_dgrad_scatter, FormDgradScatter):
// every valid row lands in its slot of its rank's buffer with the bits of the dense dgrad (whose
// rows a push would copy there), padding rows and the slots nobody routes to stay untouched, a
// window's rows (row_base) read their own tables, and nothing is stored once the abort word is set.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "grouped_gemm_cases.h"
#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "mok/workload.hpp"

namespace mok::test {
namespace {

using grouped::Device;

struct ScatterCase {
  std::vector<int32_t> counts;
  int64_t inter, hidden;
  int ranks;
  int64_t row_base;  // rows of the tables before the call's (a window's first row)
  int block_n;
  bool cluster;
};

// Runs the case and compares the ranks' slot buffers with the dense dgrad's rows copied to their
// slots on the host; `abort_set`: the abort word is nonzero, so every buffer must stay as it was.
void scatter_case(const ScatterCase& c, bool abort_set, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "inter=" << c.inter << " hidden=" << c.hidden << " ranks=" << c.ranks
                                  << " row_base=" << c.row_base << " bn=" << c.block_n << " cluster=" << c.cluster
                                  << " abort=" << abort_set);
  const Routed rt(c.counts);
  const int64_t E = int64_t(c.counts.size()), K = 2 * c.inter, N = c.hidden, rows = rt.rows;
  const auto dgu = routed_input(rt, K, seed);
  const auto wg = random_bf16(size_t(E * c.inter * N), seed + 1, 0.05);
  const auto wu = random_bf16(size_t(E * c.inter * N), seed + 2, 0.05);
  // The tables: the window's rows after row_base rows pointing at a trap slot (the last of rank
  // 0's buffer) that a misread base would hit; each valid row a distinct slot of a random rank.
  Rng rng(seed + 3);
  const int64_t slots = rows + 1, trap = rows;
  std::vector<int32_t> rank(size_t(c.row_base + rows), 0), slot(size_t(c.row_base + rows), int32_t(trap));
  std::vector<std::vector<int32_t>> free_slots(size_t(c.ranks), std::vector<int32_t>(size_t(rows)));
  for (auto& f : free_slots) {
    std::iota(f.begin(), f.end(), 0);
    for (size_t i = f.size(); i > 1; --i) std::swap(f[i - 1], f[size_t(rng.next() % i)]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const size_t g = size_t(c.row_base + r);
    if (rt.expert_of(r) < 0) {
      rank[g] = -1, slot[g] = -1;
      continue;
    }
    rank[g] = int32_t(rng.next() % uint64_t(c.ranks));
    slot[g] = free_slots[size_t(rank[g])].back();
    free_slots[size_t(rank[g])].pop_back();
  }
  DevBuf d_gu(dgu.size() * 2), d_wg(wg.size() * 2), d_wu(wu.size() * 2), d_te(rt.tile_expert.size() * 4 + 4),
      d_dx(size_t(rows * N) * 2), d_rank(rank.size() * 4), d_slot(slot.size() * 4), d_to(size_t(c.ranks) * 8),
      d_abort(4);
  upload(d_gu, dgu);
  upload(d_wg, wg);
  upload(d_wu, wu);
  upload(d_te, rt.tile_expert);
  upload(d_rank, rank);
  upload(d_slot, slot);
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<void*> to;
  for (int w = 0; w < c.ranks; ++w) {
    bufs.push_back(std::make_unique<DevBuf>(size_t(slots * N) * 2));
    grouped::poison(*bufs.back());
    to.push_back(bufs.back()->p);
  }
  upload(d_to, to);
  const uint32_t abort_word = abort_set ? 1u : 0u;
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d_abort.p, &abort_word, 4, cudaMemcpyHostToDevice));

  Device dev;
  dev.block_n = c.block_n;
  grouped::g_cluster = c.cluster;
  gemm::DgradArgs a{.dy = d_gu.p, .w = d_wg.p, .dx = d_dx.p, .k = K, .n = N, .experts = E,
                    .tile_expert = d_te.as<int32_t>(), .num_m_tiles = rt.num_m_tiles(), .w_up = d_wu.p};
  gemm::run(gemm::plan_dgrad(a, dev.opts(0)), nullptr);  // the dense rows
  a.dx = nullptr;
  const gemm::RowScatter sc{d_rank.as<int32_t>(), d_slot.as<int32_t>(), static_cast<void* const*>(d_to.p),
                            c.row_base, d_abort.as<uint32_t>()};
  const gemm::Plan plan = gemm::plan_dgrad_scatter(a, sc, dev.opts(0));
  grouped::g_cluster = false;
  ASSERT_EQ(plan.form, gemm::Form::DgradScatter);
  gemm::run(plan, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";

  const auto dense = download<uint16_t>(d_dx, size_t(rows * N));
  std::vector<std::vector<uint16_t>> want(size_t(c.ranks), std::vector<uint16_t>(size_t(slots * N), kNaNBits));
  if (!abort_set)
    for (int64_t r = 0; r < rows; ++r) {
      const size_t g = size_t(c.row_base + r);
      if (rank[g] < 0) continue;
      std::copy_n(dense.begin() + r * N, N, want[size_t(rank[g])].begin() + int64_t(slot[g]) * N);
    }
  for (int w = 0; w < c.ranks; ++w) {
    const auto got = download<uint16_t>(*bufs[size_t(w)], size_t(slots * N));
    int64_t diff = 0, first = -1;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[size_t(w)][i] && diff++ == 0) first = int64_t(i);
    EXPECT_EQ(diff, 0) << "rank " << w << ": " << diff << " elements differ, the first at slot " << first / N
                       << " column " << first % N;
  }
}

TEST(DgradScatter, RowsLandInTheirSlotsWithTheDenseBits) {
  // Experts with 1, 127, 129, 300 rows and none; hidden 392 (a partial 64-column chunk, a partial
  // 256-wide tile), 2 ranks; both tile widths.
  for (int bn : {256, 128})
    scatter_case({{300, 1, 0, 129, 127}, 64, 392, 2, 0, bn, false}, false, 11);
}

TEST(DgradScatter, AWindowReadsItsOwnRowsOfTheTables) {
  scatter_case({{256, 3, 200}, 128, 512, 3, 384, 256, false}, false, 21);
}

TEST(DgradScatter, ClustersAndEightRanks) {
  scatter_case({{130, 512, 64, 7, 255, 1}, 96, 1024, 8, 128, 256, true}, false, 31);
}

TEST(DgradScatter, NothingIsStoredOnceTheAbortWordIsSet) {
  scatter_case({{300, 129}, 64, 256, 2, 0, 256, false}, true, 41);
  scatter_case({{300, 129}, 64, 256, 2, 0, 256, false}, false, 41);  // (and the case itself stores)
}

TEST(DgradScatter, ArgumentsAreNamed) {
  DevBuf d(1024);
  gemm::DgradArgs a{.dy = d.p, .w = d.p, .dx = nullptr, .k = 64, .n = 64, .experts = 1,
                    .tile_expert = d.as<int32_t>(), .num_m_tiles = 1};
  gemm::RowScatter sc;
  sc.to = reinterpret_cast<void* const*>(d.p);
  try {
    (void)gemm::plan_dgrad_scatter(a, sc, {});
    FAIL() << "plan_dgrad_scatter accepted scatter.to without the tables";
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dgrad_scatter.to"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mok::test
