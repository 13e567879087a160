// GPU merges vs the CPU reference's merge: bitwise equal (same fp32 operations, same order).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megakernel/merge.h"
#include "mok/workload.hpp"
#include "reference/merge_ref.h"

namespace {

using mok::test::download;
using mok::test::upload;

struct Case {
  int64_t T, k, H;
  bool shared, aborted;  // aborted: the communicator's abort word is set (out must be all NaN)
};

void run_case(const Case& c, bool weighted) {
  mok::Rng rng(1234 + c.T * 7 + c.k);
  std::vector<mok::bf16> shared(c.T * c.H), slots(c.T * c.k * c.H);
  std::vector<float> shared_f(shared.size()), slots_f(slots.size()), w(c.T * c.k);
  std::vector<int32_t> idx(c.T * c.k);
  for (size_t i = 0; i < shared.size(); ++i) {
    shared[i] = mok::bf16(float(rng.normal()));
    shared_f[i] = float(shared[i]);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    slots[i] = mok::bf16(float(rng.normal()));
    slots_f[i] = float(slots[i]);
  }
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = rng.uniform() < 0.2 ? -1 : int32_t(rng.below(64));
    w[i] = float(rng.uniform());
  }
  const auto expect = mok::ref::merge_rows(c.shared ? shared_f.data() : nullptr, slots_f.data(),
                                           weighted ? w.data() : nullptr, idx.data(), c.T, c.k,
                                           c.H, 1);

  auto* d_shared = upload(shared);
  auto* d_slots = upload(slots);
  auto* d_w = upload(w);
  int32_t* d_idx = upload(idx);
  uint32_t* d_abort = upload(std::vector<uint32_t>{c.aborted ? 0x80001234u : 0u});
  mok::bf16* d_out = nullptr;
  MOK_ASSERT_CUDA(cudaMalloc(&d_out, std::max<size_t>(1, expect.size() * 2)));
  MOK_ASSERT_CUDA(cudaMemset(d_out, 0xFF, expect.size() * 2));  // poison: NaN bf16

  mok::gpu::MergeArgs a;
  a.shared = c.shared ? d_shared : nullptr;
  a.slots = d_slots;
  a.weights = d_w;
  a.topk_idx = d_idx;
  a.abort = d_abort;
  a.tokens = c.T;
  a.top_k = c.k;
  a.hidden = c.H;
  a.out = d_out;
  if (weighted)
    mok::gpu::merge_forward(a, nullptr);
  else
    mok::gpu::merge_backward(a, nullptr);
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<mok::bf16> got(expect.size());
  MOK_ASSERT_CUDA(cudaMemcpy(got.data(), d_out, got.size() * 2, cudaMemcpyDeviceToHost));
  int64_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i)
    mismatches += c.aborted ? !std::isnan(float(got[i])) : got[i].bits != expect[i].bits;
  EXPECT_EQ(mismatches, 0) << "of " << got.size() << " values (T=" << c.T << " k=" << c.k
                           << " H=" << c.H << ")";
  cudaFree(d_shared);
  cudaFree(d_slots);
  cudaFree(d_w);
  cudaFree(d_idx);
  cudaFree(d_abort);
  cudaFree(d_out);
}

class MergeTest : public ::testing::TestWithParam<Case> {};

TEST_P(MergeTest, ForwardBitwiseEqualsReference) {
  MOK_REQUIRE_GPUS(1);
  run_case(GetParam(), true);
}

TEST_P(MergeTest, BackwardBitwiseEqualsReference) {
  MOK_REQUIRE_GPUS(1);
  run_case(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MergeTest,
                         ::testing::Values(Case{1000, 8, 7168, true, false},
                                           Case{513, 8, 2048, false, true},
                                           Case{0, 8, 2048, true, false},
                                           Case{77, 1, 64, true, true},
                                           Case{300, 16, 4096, false, false}),
                         [](const auto& p) {
                           const Case& c = p.param;
                           return "T" + std::to_string(c.T) + "_k" + std::to_string(c.k) + "_H" +
                                  std::to_string(c.H) + (c.shared ? "_shared" : "") +
                                  (c.aborted ? "_aborted" : "");
                         });

}  // namespace
