// The CPU reference engine against a naive fp64 dense model, and its layout invariances.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>

#include "mok/errors.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"
#include "reference/fp64_model.h"
#include "test_names.h"

namespace {

using mok::bf16;
using mok::ref::flat_f64;
using mok::ref::rel_error;

// Splits a W = 1 workload's tokens into contiguous per-rank pieces of the given sizes.
mok::Workload split(const mok::Workload& one, const std::vector<int64_t>& tokens) {
  mok::Workload w = one;
  w.shape.tokens = tokens;
  w.inputs.clear();
  w.d_out.clear();
  const int64_t H = one.shape.hidden, k = one.shape.top_k;
  int64_t t0 = 0;
  for (int64_t T : tokens) {
    const auto& src = one.inputs[0];
    mok::ref::RankInput in;
    in.x.assign(src.x.begin() + t0 * H, src.x.begin() + (t0 + T) * H);
    in.topk_idx.assign(src.topk_idx.begin() + t0 * k, src.topk_idx.begin() + (t0 + T) * k);
    in.topk_w.assign(src.topk_w.begin() + t0 * k, src.topk_w.begin() + (t0 + T) * k);
    w.inputs.push_back(std::move(in));
    w.d_out.emplace_back(one.d_out[0].begin() + t0 * H, one.d_out[0].begin() + (t0 + T) * H);
    t0 += T;
  }
  return w;
}

bool bitwise_equal(const std::vector<std::vector<bf16>>& a, const std::vector<std::vector<bf16>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r) {
    if (a[r].size() != b[r].size()) return false;
    for (size_t i = 0; i < a[r].size(); ++i)
      if (a[r][i].bits != b[r][i].bits) return false;
  }
  return true;
}

// Concatenates per-rank tensors (for comparing W ranks with W = 1).
template <typename T>
std::vector<std::vector<T>> concat(const std::vector<std::vector<T>>& v) {
  std::vector<T> o;
  for (const auto& r : v) o.insert(o.end(), r.begin(), r.end());
  return {o};
}

}  // namespace

class ReferenceVsFp64 : public ::testing::TestWithParam<std::tuple<mok::Routing, int, bool>> {};

TEST_P(ReferenceVsFp64, ForwardAndBackward) {
  const auto [routing, W, with_shared] = GetParam();
  auto shape = mok::LayerShape::uniform(W, 48, 128, 128, 8, 2, with_shared ? 64 : 0);
  if (W > 1) shape.tokens[1] = 17;
  const auto wl = mok::make_workload(shape, routing, 99 + W);
  const mok::ref::Engine eng(shape, mok::Config{});
  const auto fwd = eng.forward(wl.inputs, wl.weights);
  const auto g = eng.backward(wl.inputs, wl.weights, wl.d_out);
  // The same comparison (and tolerances) as mok_bench's CPU verdict.
  const auto c = mok::ref::compare_to_f64(wl, fwd, &g);
  EXPECT_LT(c.forward_rel_err, mok::ref::kF64ForwardTol);
  EXPECT_GT(c.forward_rel_err, 0.0) << "bf16 rounding must show: an exact match means the test is not comparing";
  ASSERT_EQ(c.backward.size(), with_shared ? 8u : 5u);
  for (const auto& e : c.backward) EXPECT_LT(e.rel_err, mok::ref::kF64BackwardTol) << e.name;
  EXPECT_TRUE(c.within_tolerances());
}

// The verdict rule mok_bench's CPU mode prints: every error strictly under its bound, a NaN
// error fails and is the worst one.
TEST(F64Comparison, VerdictNeedsEveryErrorUnderItsBound) {
  mok::ref::F64Comparison c;
  c.forward_rel_err = 0.5 * mok::ref::kF64ForwardTol;
  EXPECT_TRUE(c.within_tolerances());
  EXPECT_EQ(c.worst_backward(), nullptr);
  c.backward = {{"d_x", 1e-3}, {"d_w_up", 5e-3}, {"d_w_down", 2e-3}};
  EXPECT_TRUE(c.within_tolerances());
  EXPECT_STREQ(c.worst_backward()->name, "d_w_up");
  c.backward[2].rel_err = mok::ref::kF64BackwardTol;
  EXPECT_FALSE(c.within_tolerances());
  c.backward[2].rel_err = NAN;
  EXPECT_FALSE(c.within_tolerances());
  EXPECT_STREQ(c.worst_backward()->name, "d_w_down");
  c.backward.clear();
  c.forward_rel_err = NAN;
  EXPECT_FALSE(c.within_tolerances());
}

INSTANTIATE_TEST_SUITE_P(
    Routings, ReferenceVsFp64,
    ::testing::Combine(::testing::Values(mok::Routing::Uniform, mok::Routing::Zipf,
                                         mok::Routing::OneExpert, mok::Routing::OneRank,
                                         mok::Routing::EmptySlots),
                       ::testing::Values(1, 2), ::testing::Bool()),
    [](const auto& p) {
      return mok::test::param_name(std::string(mok::to_string(std::get<0>(p.param))) + "_W" +
                                   std::to_string(std::get<1>(p.param)) +
                                   (std::get<2>(p.param) ? "_shared" : "_noshared"));
    });

class WorldInvariance : public ::testing::TestWithParam<mok::Routing> {};

// The same global problem on W = 1, 2, 4, 8 simulated ranks (even and uneven token splits, one
// rank with T = 0): outputs and gradients are bitwise identical; shared-expert gradients are
// per-rank partial sums and add up to the W = 1 value.
TEST_P(WorldInvariance, BitwiseSameAsOneRank) {
  const auto one_shape = mok::LayerShape::uniform(1, 160, 128, 64, 16, 4, 64);
  const auto one = mok::make_workload(one_shape, GetParam(), 2024);
  mok::Config cfg;
  const auto base_f = mok::ref::Engine(one_shape, cfg).forward(one.inputs, one.weights);
  const auto base_g = mok::ref::Engine(one_shape, cfg).backward(one.inputs, one.weights, one.d_out);
  for (const std::vector<int64_t>& split_sizes :
       {std::vector<int64_t>{80, 80}, {40, 40, 40, 40}, {20, 20, 20, 20, 20, 20, 20, 20},
        {0, 100, 7, 53}, {1, 2, 3, 0, 50, 50, 50, 4}}) {
    const auto wl = split(one, split_sizes);
    SCOPED_TRACE("W = " + std::to_string(split_sizes.size()));
    const mok::ref::Engine eng(wl.shape, cfg);
    const auto f = eng.forward(wl.inputs, wl.weights);
    EXPECT_TRUE(bitwise_equal(concat(f.out), base_f.out));
    const auto g = eng.backward(wl.inputs, wl.weights, wl.d_out);
    EXPECT_TRUE(bitwise_equal(concat(g.d_x), base_g.d_x));
    EXPECT_EQ(concat(g.d_topk_w), base_g.d_topk_w);
    EXPECT_TRUE(bitwise_equal({g.d_w_gate}, {base_g.d_w_gate}));
    EXPECT_TRUE(bitwise_equal({g.d_w_up}, {base_g.d_w_up}));
    EXPECT_TRUE(bitwise_equal({g.d_w_down}, {base_g.d_w_down}));
    std::vector<double> sum(base_g.d_ws_down[0].size(), 0.0);
    for (const auto& r : g.d_ws_down)
      for (size_t i = 0; i < r.size(); ++i) sum[i] += double(float(r[i]));
    EXPECT_LT(rel_error(sum, flat_f64(base_g.d_ws_down[0])), 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, WorldInvariance,
                         ::testing::Values(mok::Routing::Uniform, mok::Routing::Zipf,
                                           mok::Routing::EmptySlots),
                         [](const auto& p) { return mok::test::param_name(mok::to_string(p.param)); });

TEST(ReferenceDeterminism, BitwiseOverRunsAndThreadCounts) {
  const auto shape = mok::LayerShape::uniform(4, 64, 128, 64, 8, 2, 64);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 11);
  mok::Config cfg;
  cfg.cpu_threads = 1;
  const auto f1 = mok::ref::Engine(shape, cfg).forward(wl.inputs, wl.weights);
  const auto g1 = mok::ref::Engine(shape, cfg).backward(wl.inputs, wl.weights, wl.d_out);
  for (int threads : {1, 2, 3, 7}) {
    cfg.cpu_threads = threads;
    const mok::ref::Engine eng(shape, cfg);
    for (int rep = 0; rep < 2; ++rep) {
      EXPECT_TRUE(bitwise_equal(eng.forward(wl.inputs, wl.weights).out, f1.out)) << threads;
      const auto g = eng.backward(wl.inputs, wl.weights, wl.d_out);
      EXPECT_TRUE(bitwise_equal(g.d_x, g1.d_x)) << threads;
      EXPECT_EQ(g.d_topk_w, g1.d_topk_w) << threads;
      EXPECT_TRUE(bitwise_equal({g.d_w_down}, {g1.d_w_down})) << threads;
      EXPECT_TRUE(bitwise_equal(g.d_ws_gate, g1.d_ws_gate)) << threads;
    }
  }
}

TEST(ReferenceRing, SmallRingGivesSameResults) {
  const auto shape = mok::LayerShape::uniform(2, 200, 128, 64, 4, 2, 0);
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 12);
  mok::Config big, small;
  small.minibatch_tokens = 128;
  small.macrobatch_tokens = 128;  // one tile per refill
  const auto fb = mok::ref::Engine(shape, big).forward(wl.inputs, wl.weights);
  const auto fs = mok::ref::Engine(shape, small).forward(wl.inputs, wl.weights);
  for (int64_t m : fs.macrobatches) EXPECT_GE(m, 3);
  EXPECT_EQ(fb.macrobatches, (std::vector<int64_t>{1, 1}));
  EXPECT_TRUE(bitwise_equal(fb.out, fs.out));
  const auto gb = mok::ref::Engine(shape, big).backward(wl.inputs, wl.weights, wl.d_out);
  const auto gs = mok::ref::Engine(shape, small).backward(wl.inputs, wl.weights, wl.d_out);
  EXPECT_TRUE(bitwise_equal(gb.d_x, gs.d_x));
  EXPECT_TRUE(bitwise_equal({gb.d_w_gate}, {gs.d_w_gate}));
}

TEST(ReferenceEdges, EmptySlotsAndZeroTokens) {
  auto shape = mok::LayerShape::uniform(2, 8, 64, 64, 4, 2, 0);
  shape.tokens[1] = 0;
  auto wl = mok::make_workload(shape, mok::Routing::Uniform, 13);
  // Token 3: both slots empty -> output 0 and d_topk_w 0; token 5: one slot empty.
  wl.inputs[0].topk_idx[6] = wl.inputs[0].topk_idx[7] = -1;
  wl.inputs[0].topk_idx[11] = -1;
  const mok::ref::Engine eng(shape, mok::Config{});
  const auto f = eng.forward(wl.inputs, wl.weights);
  ASSERT_EQ(f.out[1].size(), 0u);
  for (int h = 0; h < 64; ++h) EXPECT_EQ(float(f.out[0][3 * 64 + h]), 0.0f);
  const auto g = eng.backward(wl.inputs, wl.weights, wl.d_out);
  EXPECT_EQ(g.d_topk_w[0][6], 0.0f);
  EXPECT_EQ(g.d_topk_w[0][7], 0.0f);
  EXPECT_EQ(g.d_topk_w[0][11], 0.0f);
  EXPECT_NE(g.d_topk_w[0][10], 0.0f);
  for (int h = 0; h < 64; ++h) EXPECT_EQ(float(g.d_x[0][3 * 64 + h]), 0.0f);
  EXPECT_EQ(g.d_x[1].size(), 0u);
}

TEST(ReferenceEdges, ExpertWithoutTokensHasZeroGradient) {
  auto shape = mok::LayerShape::uniform(1, 32, 64, 64, 4, 1, 0);
  auto wl = mok::make_workload(shape, mok::Routing::Uniform, 14);
  for (auto& e : wl.inputs[0].topk_idx) e = e == 2 ? 1 : e;  // expert 2 unused
  const auto g = mok::ref::Engine(shape, mok::Config{}).backward(wl.inputs, wl.weights, wl.d_out);
  for (int64_t i = 2 * 64 * 64; i < 3 * 64 * 64; ++i) {
    EXPECT_EQ(g.d_w_gate[i].bits, 0);
    EXPECT_EQ(g.d_w_down[i].bits, 0);
  }
}

// Config::precision FP8 (recipe 1): the reference's forward with x quantized per 1 x 128 at its
// source, every weight matrix per 128 x 128 and h per 1 x 128 before FC2 (fp32 scales). Against
// the fp64 model of the bf16 values: E4M3 keeps 3 mantissa bits, so a Gaussian value's relative
// rounding error has an RMS of about 2.7%, and one GEMM with both operands quantized a relative
// error of about sqrt(2) x 2.7% = 3.8% on random-sign data (the terms' errors add like the terms;
// a numpy check of 64 x 256 x 64 gives 3.8%); two GEMMs and h's quantization measure 6.5% here.
// So issue 22's 3e-2 bar is below what the format allows on such data; the test bounds it at 8e-2 and demands
// that the quantization shows (well above the bf16 reference's error). It is deterministic and
// independent of the number of ranks and of the ring (quantization is per token row and per
// weight matrix, not per routed segment). MXFP8 (recipe 2: an
// E8M0 scale per 32 along K) has the same mantissa; its power-of-two scales put a block's maximum
// anywhere in [256, 512) and clamp it at 448, which costs a little more: 7.6% here, bounded at 9e-2.
TEST(ReferenceFp8, ForwardWithinTheFp8BarAndIndependentOfTheLayout) {
  for (const auto precision : {mok::Precision::FP8, mok::Precision::MXFP8})
  for (const bool with_shared : {false, true}) {
    SCOPED_TRACE(testing::Message() << mok::to_string(precision) << (with_shared ? ", shared expert" : ""));
    auto shape = mok::LayerShape::uniform(1, 96, 256, 256, 8, 2, with_shared ? 128 : 0);
    const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 321);
    mok::Config fp8;
    fp8.precision = precision;
    const mok::ref::Engine e8(shape, fp8), e16(shape, mok::Config{});
    const auto out8 = e8.forward(wl.inputs, wl.weights);
    const auto out16 = e16.forward(wl.inputs, wl.weights);
    const auto want = mok::ref::f64_forward(shape, wl, mok::ref::to_f64(wl));
    const double err8 = rel_error(flat_f64(out8.out), flat_f64(want));
    const double err16 = rel_error(flat_f64(out16.out), flat_f64(want));
    std::printf("[reference %s] %s: rel err vs fp64 %.2e (bf16 reference: %.2e)\n", mok::to_string(precision),
                with_shared ? "shared" : "routed only", err8, err16);
    EXPECT_LT(err8, precision == mok::Precision::FP8 ? 8e-2 : 9e-2);
    EXPECT_GT(err8, 4 * err16) << "the FP8 quantization must show in the error";
    EXPECT_TRUE(bitwise_equal(out8.out, e8.forward(wl.inputs, wl.weights).out)) << "not deterministic";
    // The same tokens over 4 ranks (one without tokens; a ring of 2 minibatches): the same bits.
    const auto wl3 = split(wl, {40, 0, 26, 30});
    mok::Config fp8_ring = fp8;
    fp8_ring.minibatch_tokens = 128;
    fp8_ring.macrobatch_tokens = 256;
    const mok::ref::Engine e3(wl3.shape, fp8_ring);
    EXPECT_TRUE(bitwise_equal(concat(e3.forward(wl3.inputs, wl3.weights).out), out8.out)) << "depends on the layout";
  }
}

// The FP8 backward (recipe 1, notes/fp8.md): FC2's dgrad reads d_out per 1 x 128 along H, FC1's
// [d_g d_u] per 1 x 128 in the packed order (the gate and up values of 64 intermediate columns),
// both with the weights' forward codes; the weight gradients read their operands per 128 x 1
// (K = tokens: one block per 128-row M tile of the expert's rows in token order, the shared
// expert's per 128 of the rank's tokens), x from its bf16 rows; d_topk_w = <g, h> over the FP8
// h. Against the fp64 model: every gradient within the budget of its quantized operands (~2.6%
// each, in quadrature) and clearly above bf16's error; bitwise the same over thread counts, a
// small ring, and the same tokens over 4 ranks (d_x, d_topk_w and the routed experts' weight
// gradients: the blocks are the same M tiles in every layout). MXFP8 (recipe 2) the same, each
// operand blocked by 32 along its GEMM's K (1 x 32 rows, 32 x 1 token blocks, the dgrads' weights
// along H and I).
TEST(ReferenceFp8, BackwardWithinItsBudgetAndIndependentOfTheLayout) {
  for (const mok::Precision precision : {mok::Precision::FP8, mok::Precision::MXFP8})
  for (const bool with_shared : {false, true}) {
    SCOPED_TRACE(testing::Message() << mok::to_string(precision) << (with_shared ? ", shared expert" : ", routed only"));
    auto shape = mok::LayerShape::uniform(1, 288, 256, 256, 8, 2, with_shared ? 128 : 0);
    const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 77);
    mok::Config fp8;
    fp8.precision = precision;
    const mok::ref::Engine e8(shape, fp8), e16(shape, mok::Config{});
    const auto f8 = e8.forward(wl.inputs, wl.weights);
    const auto g8 = e8.backward(wl.inputs, wl.weights, wl.d_out);
    const auto g16 = e16.backward(wl.inputs, wl.weights, wl.d_out);
    const auto c8 = mok::ref::compare_to_f64(wl, f8, &g8);
    const auto c16 = mok::ref::compare_to_f64(wl, e16.forward(wl.inputs, wl.weights), &g16);
    ASSERT_EQ(c8.backward.size(), c16.backward.size());
    for (size_t i = 0; i < c8.backward.size(); ++i) {
      const auto& e = c8.backward[i];
      std::printf("[reference %s backward] %s: %s rel err vs fp64 %.2e (bf16 reference: %.2e)\n",
                  mok::to_string(precision), with_shared ? "shared" : "routed only", e.name, e.rel_err,
                  c16.backward[i].rel_err);
      EXPECT_LT(e.rel_err, 0.15) << e.name;
      EXPECT_GT(e.rel_err, 3 * c16.backward[i].rel_err) << e.name << ": the FP8 quantization must show";
    }
    mok::Config fp8_threads = fp8;
    fp8_threads.cpu_threads = 3;
    fp8_threads.minibatch_tokens = 128;
    fp8_threads.macrobatch_tokens = 128;  // one M tile per ring window
    const auto gs = mok::ref::Engine(shape, fp8_threads).backward(wl.inputs, wl.weights, wl.d_out);
    EXPECT_TRUE(bitwise_equal(gs.d_x, g8.d_x)) << "d_x depends on the ring or the threads";
    EXPECT_EQ(gs.d_topk_w, g8.d_topk_w);
    EXPECT_TRUE(bitwise_equal({gs.d_w_gate, gs.d_w_up, gs.d_w_down}, {g8.d_w_gate, g8.d_w_up, g8.d_w_down}))
        << "the weight gradients depend on the ring or the threads";
    if (!with_shared) {  // (the shared expert's gradients are per-rank partial sums)
      const auto wl4 = split(wl, {100, 0, 90, 98});
      const auto g4 = mok::ref::Engine(wl4.shape, fp8_threads).backward(wl4.inputs, wl4.weights, wl4.d_out);
      EXPECT_TRUE(bitwise_equal(concat(g4.d_x), g8.d_x)) << "d_x depends on the ranks";
      EXPECT_EQ(concat(g4.d_topk_w), g8.d_topk_w);
      EXPECT_TRUE(bitwise_equal({g4.d_w_gate, g4.d_w_down}, {g8.d_w_gate, g8.d_w_down}))
          << "the routed weight gradients depend on the ranks";
    }
  }
}
