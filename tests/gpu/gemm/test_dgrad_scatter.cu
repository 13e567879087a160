// FC1's dgrad with the reverse dispatch in its epilogue (gemm::plan_dgrad_scatter, FormDgradScatter):
// every valid row lands in its slot of its rank's buffer with the bits of the dense dgrad (whose
// rows a push would copy there), padding rows and the slots nobody routes to stay untouched, a
// window's rows (row_base) read their own tables, and nothing is stored once the abort word is set.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_test_util.h"
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
  int64_t spare_tiles = 0;  // tiles of expert -1 after the routed ones (stale tables behind them)
};

// The destinations of a case: the tables (the call's rows after row_base rows that point at a
// trap slot, the last of rank 0's buffer, which a misread base would hit; each valid row a
// distinct slot of a random rank, padding rows -1) and the ranks' slot buffers, poisoned.
struct Slots {
  int64_t rows, n, slots;
  std::vector<int32_t> rank, slot;
  std::vector<std::unique_ptr<DevBuf>> bufs;
  DevBuf d_rank, d_slot, d_to, d_abort{4};
  // spare: rows after the call's valid tiles (tiles of expert -1, as past a layer's routed rows at
  // its capacity) whose table entries are stale: they point at the trap too.
  Slots(const Routed& rt, int64_t n_, int ranks, int64_t row_base, bool abort_set, uint64_t seed, int64_t spare = 0)
      : rows(rt.rows), n(n_), slots(rt.rows + 1),
        rank(size_t(row_base + rt.rows + spare), 0), slot(size_t(row_base + rt.rows + spare), int32_t(rt.rows)),
        d_rank(size_t(row_base + rt.rows + spare) * 4), d_slot(size_t(row_base + rt.rows + spare) * 4),
        d_to(size_t(ranks) * 8) {
    Rng rng(seed);
    std::vector<std::vector<int32_t>> free_slots(static_cast<size_t>(ranks), std::vector<int32_t>(static_cast<size_t>(rows)));
    for (auto& f : free_slots) {
      std::iota(f.begin(), f.end(), 0);
      for (size_t i = f.size(); i > 1; --i) std::swap(f[i - 1], f[size_t(rng.next() % i)]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const size_t g = size_t(row_base + r);
      if (rt.expert_of(r) < 0) {
        rank[g] = -1, slot[g] = -1;
        continue;
      }
      rank[g] = int32_t(rng.next() % uint64_t(ranks));
      slot[g] = free_slots[size_t(rank[g])].back();
      free_slots[size_t(rank[g])].pop_back();
    }
    upload(d_rank, rank);
    upload(d_slot, slot);
    std::vector<void*> to;
    for (int w = 0; w < ranks; ++w) {
      bufs.push_back(std::make_unique<DevBuf>(size_t(slots * n) * 2));
      grouped::poison(*bufs.back());
      to.push_back(bufs.back()->p);
    }
    upload(d_to, to);
    const uint32_t word = abort_set ? 1u : 0u;
    EXPECT_EQ(cudaSuccess, cudaMemcpy(d_abort.p, &word, 4, cudaMemcpyHostToDevice));
    scatter = gemm::RowScatter{d_rank.as<int32_t>(), d_slot.as<int32_t>(), static_cast<void* const*>(d_to.p),
                               row_base, d_abort.as<uint32_t>()};
    base = row_base;
    aborted = abort_set;
  }
  gemm::RowScatter scatter;
  int64_t base = 0;
  bool aborted = false;
  // Every buffer against the dense rows [rows, n] copied to their slots (nothing with the abort set).
  void expect(const std::vector<uint16_t>& dense) const {
    for (size_t w = 0; w < bufs.size(); ++w) {
      std::vector<uint16_t> want(size_t(slots * n), kNaNBits);
      if (!aborted)
        for (int64_t r = 0; r < rows; ++r) {
          const size_t g = size_t(base + r);
          if (rank[g] == int32_t(w)) std::copy_n(dense.begin() + r * n, n, want.begin() + int64_t(slot[g]) * n);
        }
      const auto got = download<uint16_t>(*bufs[w], size_t(slots * n));
      int64_t diff = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != want[i] && diff++ == 0) first = int64_t(i);
      EXPECT_EQ(diff, 0) << "rank " << w << ": " << diff << " elements differ, the first at slot " << first / n
                         << " column " << first % n;
    }
  }
};

// The bf16 FC1 dgrad (gate/up B): the dense plan, then the scatter plan into the slots.
void scatter_case(const ScatterCase& c, bool abort_set, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "inter=" << c.inter << " hidden=" << c.hidden << " ranks=" << c.ranks
                                  << " row_base=" << c.row_base << " bn=" << c.block_n << " cluster=" << c.cluster
                                  << " abort=" << abort_set);
  const Routed rt(c.counts);
  const int64_t E = int64_t(c.counts.size()), K = 2 * c.inter, N = c.hidden, rows = rt.rows;
  const int64_t all = rows + 128 * c.spare_tiles;
  auto dgu = routed_input(rt, K, seed);
  dgu.resize(size_t(all * K), kNaNBits);
  std::vector<int32_t> tiles = rt.tile_expert;
  tiles.resize(size_t(all / 128), -1);
  const auto wg = random_bf16(size_t(E * c.inter * N), seed + 1, 0.05);
  const auto wu = random_bf16(size_t(E * c.inter * N), seed + 2, 0.05);
  Slots to(rt, N, c.ranks, c.row_base, abort_set, seed + 3, 128 * c.spare_tiles);
  DevBuf d_gu(dgu.size() * 2), d_wg(wg.size() * 2), d_wu(wu.size() * 2), d_te(tiles.size() * 4 + 4),
      d_dx(size_t(all * N) * 2);
  upload(d_gu, dgu);
  upload(d_wg, wg);
  upload(d_wu, wu);
  upload(d_te, tiles);
  Device dev;
  dev.block_n = c.block_n;
  struct ClusterFlag {  // (reset however the case ends)
    explicit ClusterFlag(bool on) { grouped::g_cluster = on; }
    ~ClusterFlag() { grouped::g_cluster = false; }
  } cluster_flag(c.cluster);
  gemm::DgradArgs a{.dy = d_gu.p, .w = d_wg.p, .dx = d_dx.p, .k = K, .n = N, .experts = E,
                    .tile_expert = d_te.as<int32_t>(), .num_m_tiles = all / 128, .w_up = d_wu.p};
  gemm::run(gemm::plan_dgrad(a, dev.opts(0)), nullptr);  // the dense rows
  a.dx = nullptr;
  const gemm::Plan plan = gemm::plan_dgrad_scatter(a, to.scatter, dev.opts(0));
  ASSERT_EQ(plan.form, gemm::Form::DgradScatter);
  gemm::run(plan, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
  to.expect(download<uint16_t>(d_dx, size_t(rows * N)));
}

// The FP8 FC1 dgrad (Fp8Plain's operands: codes with 1 x 128 and 128 x 128 scales): the dense
// plan_fp8_grouped, then plan_fp8_grouped_scatter.
void fp8_scatter_case(const std::vector<int32_t>& counts, int64_t k, int64_t n, int block_n, int ranks,
                      int64_t row_base, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "fp8 k=" << k << " n=" << n << " bn=" << block_n << " ranks=" << ranks
                                  << " row_base=" << row_base);
  const Routed rt(counts);
  const int64_t E = int64_t(counts.size()), rows = rt.rows, kb = k / 128;
  std::vector<uint8_t> qa(size_t(rows * k)), qw(size_t(E * n * k));
  std::vector<float> sa(size_t(rows * kb)), sw(size_t(E * (n / 128) * kb));
  Rng rng(seed);
  for (auto& v : qa) v = uint8_t(rng.next() & 0x77u);  // finite E4M3 codes (no 0x7f / 0xff NaNs)
  for (auto& v : qw) v = uint8_t(rng.next() & 0x77u);
  for (auto& v : sa) v = float(std::ldexp(1.0, int(rng.next() % 5) - 8));
  for (auto& v : sw) v = float(std::ldexp(1.0, int(rng.next() % 5) - 8));
  Slots to(rt, n, ranks, row_base, false, seed + 1);
  DevBuf d_qa(qa.size()), d_sa(sa.size() * 4), d_qw(qw.size()), d_sw(sw.size() * 4), d_y(size_t(rows * n) * 2),
      d_te(rt.tile_expert.size() * 4 + 4);
  upload(d_qa, qa);
  upload(d_sa, sa);
  upload(d_qw, qw);
  upload(d_sw, sw);
  upload(d_te, rt.tile_expert);
  gemm::Fp8GroupedArgs a{.a = d_qa.p, .a_scales = d_sa.as<float>(), .w = d_qw.p, .w_scales = d_sw.as<float>(),
                         .y = d_y.p, .k = k, .n = n, .experts = E, .tile_expert = d_te.as<int32_t>(),
                         .num_m_tiles = rt.num_m_tiles()};
  Device dev;
  dev.block_n = block_n;
  gemm::run(gemm::plan_fp8_grouped(a, dev.opts(0)), nullptr);
  a.y = nullptr;
  gemm::run(gemm::plan_fp8_grouped_scatter(a, to.scatter, dev.opts(0)), nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(dev.error(), 0u) << "a bounded wait expired";
  to.expect(download<uint16_t>(d_y, size_t(rows * n)));
}

TEST(DgradScatter, RowsLandInTheirSlotsWithTheDenseBits) {
  MOK_REQUIRE_GPUS(1);
  // Experts with 1, 127, 129, 300 rows and none; hidden 392 (a partial 64-column chunk, a partial
  // 256-wide tile), 2 ranks; both tile widths.
  for (int bn : {256, 128})
    scatter_case({{300, 1, 0, 129, 127}, 64, 392, 2, 0, bn, false}, false, 11);
}

TEST(DgradScatter, AWindowReadsItsOwnRowsOfTheTables) {
  MOK_REQUIRE_GPUS(1);
  scatter_case({{256, 3, 200}, 128, 512, 3, 384, 256, false}, false, 21);
  // tiles of no expert after the routed ones, their tables stale (a layer's capacity): not stored
  scatter_case({{256, 3, 200}, 128, 512, 3, 384, 256, false, 3}, false, 22);
  scatter_case({{256, 3, 200}, 128, 512, 3, 0, 128, true, 2}, false, 23);
}

TEST(DgradScatter, ClustersAndEightRanks) {
  MOK_REQUIRE_GPUS(1);
  scatter_case({{130, 512, 64, 7, 255, 1}, 96, 1024, 8, 128, 256, true}, false, 31);
}

TEST(DgradScatter, NothingIsStoredOnceTheAbortWordIsSet) {
  MOK_REQUIRE_GPUS(1);
  scatter_case({{300, 129}, 64, 256, 2, 0, 256, false}, true, 41);
  scatter_case({{300, 129}, 64, 256, 2, 0, 128, true}, true, 42);
  scatter_case({{300, 129}, 64, 256, 2, 0, 256, false}, false, 41);  // (and the case itself stores)
}

TEST(DgradScatter, Fp8RowsLandInTheirSlotsWithTheDenseBits) {
  MOK_REQUIRE_GPUS(1);
  for (int bn : {256, 128}) fp8_scatter_case({300, 1, 0, 129}, 512, 384, bn, 3, 256, 51);
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
