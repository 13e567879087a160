// The layer's memory (tests for the training-memory issue): the device memory a layer takes
// against the planner (include/mok/memory.hpp), and the weights read where the caller keeps them
// (no packed copy, no repack): in-place updates and set_weights(). One GPU, both paths.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "layer_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/memory.hpp"
#include "mok/workload.hpp"
#include "schedule/schedule_math.h"

namespace {

using mok::test::bit_diffs;
using mok::test::expect_same_bits;
using mok::test::grads_of;
using mok::test::RankData;
using mok::test::RankGrads;
using mok::test::ranks_on_gpus;
using mok::test::two_ranks;
using mok::test::upload;

constexpr auto kMk = mok::ForwardPath::Megakernel;
constexpr auto kUnfused = mok::ForwardPath::Unfused;
std::string path_name(const ::testing::TestParamInfo<mok::ForwardPath>& i) { return mok::to_string(i.param); }

// The device memory a layer takes is what the memory planner says, within 2% (and the
// allocator's rounding): its construction (the layer's buffers and windows) and its first backward
// (the backward's own buffers), each measured as the drop in free memory, on both paths, one GPU.
// A first layer is built, run and destroyed before measuring, so that what a process allocates
// once (lazily loaded kernels, NCCL's and the runtime's pools) is not counted; its symmetric
// windows stay in the communicator's pool and are reused. The device's free memory is read: the GPU must
// be ours alone meanwhile (scripts/reliability.sh runs this after its sanitizer processes).
class LayerMemory : public ::testing::TestWithParam<mok::ForwardPath> {};

TEST_P(LayerMemory, MeasuredEqualsThePlan) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{4096}, 2048, 768, 16, 8, 0};
  mok::Config cfg;
  cfg.forward_path = GetParam();
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 91);
  auto group = ranks_on_gpus(1, shape, cfg);
  RankData d(shape, wl, 0);
  RankGrads gr(shape, 0);
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
  int sms = 0;
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const mok::MemoryPlan plan = mok::plan_memory(shape, cfg, 0, sms);
  const auto free_now = [] {
    size_t free = 0, total = 0;
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(cudaSuccess, cudaMemGetInfo(&free, &total));
    return double(free);
  };
  const auto step = [&](mok::Layer& layer) {
    d.forward_once(layer, group[0]);
    layer.backward(d.refs, dref, gr.g, group[0].stream());
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(group[0].stream()));
    layer.check();
  };
  {
    mok::Layer warm(group[0], shape, cfg, d.dw);
    step(warm);
  }
  double built = 0, backward = 0, after = 0;
  const double f0 = free_now();
  {
    mok::Layer layer(group[0], shape, cfg, d.dw);
    const double f1 = free_now();
    d.forward_once(layer, group[0]);
    const double f2 = free_now();
    layer.backward(d.refs, dref, gr.g, group[0].stream());
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(group[0].stream()));
    layer.check();
    const double f3 = free_now();
    built = f0 - f1;
    backward = f2 - f3;
    std::printf("[layer memory] %s: built %.1f MB, forward %.1f MB, backward %.1f MB (free %.1f -> %.1f MB)\n",
                mok::to_string(GetParam()), built * 1e-6, (f1 - f2) * 1e-6, backward * 1e-6, f0 * 1e-6, f3 * 1e-6);
  }
  after = f0 - free_now();
  // The warm-up layer's symmetric windows went back to the communicator's pool, which hands them
  // to the measured layer: its construction takes the rest of the plan.
  const double p_layer =
      double(plan.total(mok::MemoryScope::Layer) + plan.total(mok::MemoryScope::Saved) - plan.symmetric());
  const double p_bwd = double(plan.total(mok::MemoryScope::Backward));
  std::printf("[layer memory] planned: layer %.1f MB, backward %.1f MB; after the layer is gone %.1f MB held\n%s",
              p_layer * 1e-6, p_bwd * 1e-6, after * 1e-6, plan.table().c_str());
  EXPECT_NEAR(built, p_layer, 0.02 * p_layer + 16e6) << "construction";
  EXPECT_NEAR(backward, p_bwd, 0.02 * p_bwd + 8e6) << "first backward";
  cudaFree(d_out);
}

INSTANTIATE_TEST_SUITE_P(Paths, LayerMemory, ::testing::Values(kMk, kUnfused), path_name);

// The layer keeps no copy of the weights (FC1 reads w_gate / w_up where they are): weights changed
// in place between two steps are used by the next forward and backward, and set_weights() points a
// layer at other tensors; either way the results are bitwise those of a layer built with the new
// weights. Both paths, one GPU, with a shared expert.
class LayerWeights : public ::testing::TestWithParam<mok::ForwardPath> {};

TEST_P(LayerWeights, InPlaceUpdatesAndSetWeightsNeedNoRepack) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{640}, 1024, 256, 16, 4, 256};
  mok::Config cfg;
  cfg.forward_path = GetParam();
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 31);
  auto mixed = wl;  // the same inputs with other weights
  mixed.weights = mok::make_workload(shape, mok::Routing::Zipf, 32).weights;
  auto group = ranks_on_gpus(1, shape, cfg);
  mok::comm::Communicator& comm = group[0];
  RankData a(shape, wl, 0), b(shape, mixed, 0);
  RankGrads ga(shape, 0), gb(shape, 0);
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {a.T, a.H});
  const auto backward = [&](mok::Layer& layer, const RankData& d, const RankGrads& g) {
    g.poison();
    layer.backward(d.refs, dref, g.g, comm.stream());
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
    layer.check();
  };
  // The reference: a layer built with the new weights.
  std::vector<mok::bf16> want;
  {
    mok::Layer fresh(comm, shape, cfg, b.dw);
    want = b.forward_once(fresh, comm);
    backward(fresh, b, gb);
  }
  const auto want_grads = gb.fetch();
  mok::Layer layer(comm, shape, cfg, a.dw);
  const auto before = a.forward_once(layer, comm);
  EXPECT_GT(bit_diffs(before, want), 0) << "the two weight sets must give different outputs";
  // set_weights: the other tensors.
  layer.set_weights(b.dw);
  EXPECT_EQ(bit_diffs(a.forward_once(layer, comm), want), 0) << "forward after set_weights";
  backward(layer, a, ga);
  auto got = ga.fetch();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want_grads[i]) << "gradient " << i << " after set_weights";
  // In place: back to a's tensors, then b's values copied into them (as an optimizer step would).
  layer.set_weights(a.dw);
  EXPECT_EQ(bit_diffs(a.forward_once(layer, comm), before), 0) << "back to the first weights";
  const int64_t n[6] = {shape.local_experts() * shape.intermediate * shape.hidden,
                        shape.local_experts() * shape.intermediate * shape.hidden,
                        shape.local_experts() * shape.hidden * shape.intermediate,
                        shape.shared_intermediate * shape.hidden, shape.shared_intermediate * shape.hidden,
                        shape.hidden * shape.shared_intermediate};
  for (int i = 0; i < 6; ++i)
    ASSERT_EQ(cudaSuccess, cudaMemcpy(const_cast<void*>(a.weight_ptrs[static_cast<size_t>(i)]),
                                      b.weight_ptrs[static_cast<size_t>(i)], static_cast<size_t>(n[i]) * 2,
                                      cudaMemcpyDeviceToDevice));
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  EXPECT_EQ(bit_diffs(a.forward_once(layer, comm), want), 0) << "forward after an in-place update";
  backward(layer, a, ga);
  got = ga.fetch();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want_grads[i]) << "gradient " << i << " after an in-place update";
  cudaFree(d_out);
}

INSTANTIATE_TEST_SUITE_P(Paths, LayerWeights, ::testing::Values(kMk, kUnfused), path_name);

// The megakernel with a ring below the worst case runs the backward over windows of the ring: the
// gate/up rows of the activation budget read from the forward, FC1 recomputed past it, the weight
// gradients carried across windows in fp32. Its gradients are bitwise those of the unfused path
// (whose forward and backward run every stage once over all rows, with the same GEMM sums), on
// uniform, Zipf and one-expert routing (one expert's rows over every window), with a shared
// expert, for rings of 2 and 3 minibatches, with budgets of every row, of 2944 rows (inside a
// window: it is cut there) and of none (full recompute); and a second backward gives the same bits.
// The rings of 1536 and 2048 rows hold the rows of experts cut by a window's end (256 / 384 rows
// of hold in the gu scratch, schedule_math.h's WindowHold) where the small rings carry them all.
struct WindowCase {
  const char* name;
  mok::Routing routing;
  int64_t minibatch, ring;
  int64_t budget_bytes;  // Config::activation_budget_bytes
};
class LayerBackwardWindows : public ::testing::TestWithParam<WindowCase> {};

// The cuts the layer's windows hold over: its walk of the windows (the budget's end cutting one)
// and schedule_math.h's window_ends over the routed layout of rank 0 at EP 1 (each expert's routes,
// padded to tiles). The held cases must hold some, or their bits would say nothing about holding.
int64_t held_cuts(const mok::LayerShape& shape, const mok::Workload& wl, int64_t ring, int64_t saved, int64_t hold) {
  const auto E = static_cast<size_t>(shape.experts);
  std::vector<int32_t> rows(E, 0), offset(E, 0);
  for (const int32_t e : wl.inputs[0].topk_idx)
    if (e >= 0) ++rows[static_cast<size_t>(e)];
  for (size_t e = 1; e < E; ++e) offset[e] = offset[e - 1] + int32_t(mok::sched::pad_rows(rows[e - 1]));
  const int64_t cap = shape.worst_case_rows();
  int64_t held = 0;
  for (int64_t lo = 0, prev = 0; lo < cap;) {
    const int64_t hi = mok::sched::window_end(lo, ring, cap, saved);  // (the layer's walk)
    const mok::sched::WindowEnds w = mok::sched::window_ends(offset.data(), rows.data(), int32_t(E), lo, hi, hi == cap,
                                                             mok::sched::WindowHold{hold, prev, saved});
    held += w.held_out >= 0;
    prev = lo;
    lo = hi;
  }
  return held;
}

TEST_P(LayerBackwardWindows, BitwiseTheUnfusedBackward) {
  MOK_REQUIRE_GPUS(1);
  const WindowCase& c = GetParam();
  const mok::LayerShape shape{{1536}, 1024, 256, 16, 4, 256};
  const auto wl = mok::make_workload(shape, c.routing, 77);
  mok::Config unfused;
  unfused.forward_path = kUnfused;
  mok::Config windows;
  windows.minibatch_tokens = c.minibatch;
  windows.macrobatch_tokens = c.ring;
  windows.activation_budget_bytes = c.budget_bytes;
  ASSERT_LT(c.ring, shape.worst_case_rows()) << "the case must run over windows";
  const auto want = grads_of(shape, unfused, wl, 1);
  const auto got = grads_of(shape, windows, wl, 2);
  expect_same_bits(want, got, c.name);
  {  // a saved window's x rows pulled by FC2's dgrad's idle producer warps (gemm::RowPull): the same bits
    const mok::test::ScopedEnv beside("MOK_BWD_X_BESIDE", "1");
    expect_same_bits(want, grads_of(shape, windows, wl, 2), std::string(c.name) + " x rows beside FC2's dgrad");
  }
  {  // the pulls a window ahead on the lane with the pushes (the EP > 1 default) at EP 1: the same bits
    const mok::test::ScopedEnv ahead("MOK_BWD_PULL_AHEAD", "1");
    expect_same_bits(want, grads_of(shape, windows, wl, 2), std::string(c.name) + " pulls ahead");
    const mok::test::ScopedEnv carry("MOK_BWD_HOLD", "0");  // (every cut expert carried instead)
    expect_same_bits(want, grads_of(shape, windows, wl, 1), std::string(c.name) + " pulls ahead, carries");
  }
  // (the layer's hold: the rows of x, d_y and h that its gu scratch, ring x 4I bytes, takes)
  const int64_t hold = std::min<int64_t>(c.ring, c.ring * 4 * shape.intermediate /
                                                     (4 * shape.hidden + 2 * shape.intermediate) / 128 * 128);
  const int64_t held = hold > 0 ? held_cuts(shape, wl, c.ring, windows.resolved_saved_rows(shape), hold) : 0;
  if (hold > 0) EXPECT_GT(held, 0) << c.name << ": a held case that holds nothing";
  std::printf("[backward windows] %s: ring %lld of %lld worst-case rows, %lld rows saved, hold %lld rows, %lld cuts held\n",
              c.name, (long long)c.ring, (long long)shape.worst_case_rows(),
              (long long)windows.resolved_saved_rows(shape), (long long)hold, (long long)held);
}

// 4I = 1024 bytes per gate/up row: 2944 rows cut a window of 256 and one of 384 rows.
constexpr int64_t kAllRows = int64_t(1) << 40, kPartRows = 2944 * 1024;
INSTANTIATE_TEST_SUITE_P(
    Rings, LayerBackwardWindows,
    ::testing::Values(WindowCase{"uniform_ring256_saved", mok::Routing::Uniform, 128, 256, kAllRows},
                      WindowCase{"uniform_ring256_part", mok::Routing::Uniform, 128, 256, kPartRows},
                      WindowCase{"uniform_ring256_recompute", mok::Routing::Uniform, 128, 256, 0},
                      WindowCase{"zipf_ring384_saved", mok::Routing::Zipf, 128, 384, kAllRows},
                      WindowCase{"zipf_ring384_part", mok::Routing::Zipf, 128, 384, kPartRows},
                      WindowCase{"zipf_ring384_recompute", mok::Routing::Zipf, 128, 384, 0},
                      WindowCase{"one_expert_ring512_saved", mok::Routing::OneExpert, 256, 512, kAllRows},
                      WindowCase{"one_expert_ring512_part", mok::Routing::OneExpert, 256, 512, kPartRows},
                      WindowCase{"one_expert_ring512_recompute", mok::Routing::OneExpert, 256, 512, 0},
                      WindowCase{"uniform_ring1536_saved", mok::Routing::Uniform, 128, 1536, kAllRows},
                      WindowCase{"zipf_ring1536_part", mok::Routing::Zipf, 128, 1536, kPartRows},
                      WindowCase{"one_expert_ring2048_saved", mok::Routing::OneExpert, 256, 2048, kAllRows}),
    [](const auto& i) { return std::string(i.param.name); });

// One GPU without a shared expert: the megakernel's comm CTAs read the caller's x, so the forward
// leaves the x window as it was, and a backward over windows stages x there before it pulls the
// rows again (with a workspace of its own; a shared one is staged anyway). Resident and both
// windowed modes give the unfused path's gradients, bit for bit.
TEST(LayerCallersX, WindowsStageXTheForwardDidNotCopy) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{1536}, 1024, 256, 16, 4, 0};
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 78);
  mok::Config unfused;
  unfused.forward_path = kUnfused;
  const auto want = grads_of(shape, unfused, wl, 1);
  mok::Config resident;
  resident.workspace_budget_bytes = 0;
  expect_same_bits(want, grads_of(shape, resident, wl, 2), "resident");
  for (const bool shared : {false, true}) {
    mok::Config windows;
    windows.minibatch_tokens = 128;
    windows.macrobatch_tokens = 384;
    windows.share_workspace = shared;
    windows.workspace_budget_bytes = shared ? -1 : 0;
    ASSERT_LT(windows.macrobatch_tokens, shape.worst_case_rows());
    expect_same_bits(want, grads_of(shape, windows, wl, 2), shared ? "windows, shared workspace" : "windows, own workspace");
  }
  {  // Over windows after such a forward the backward reads in.x: the window itself is refused by name.
    mok::Config own;
    own.minibatch_tokens = 128;
    own.macrobatch_tokens = 384;
    own.share_workspace = false;
    own.workspace_budget_bytes = 0;
    auto group = ranks_on_gpus(1, shape, own);
    RankData d(shape, wl, 0);
    RankGrads gr(shape, 0);
    mok::Layer layer(group[0], shape, own, d.dw);
    d.forward_once(layer, group[0]);
    mok::RoutingRefs in_window = d.refs;
    in_window.x.data = layer.input_buffer();
    std::string arg = "(accepted)";
    try {
      layer.backward(in_window, d.out_ref(), gr.g, group[0].stream());
    } catch (const mok::Error& e) {
      arg = e.argument();
    }
    EXPECT_EQ(arg, "x");
  }
}

// Config::saved_forwards = 3 with a ring below the worst case: three forwards of one layer (the
// same weights, microbatches of other tokens and routings) before their backwards, which run in
// reverse order: each microbatch's output and gradients are bitwise those of the layer run on it
// alone (saved_forwards 1). Then four more forwards: the first of them lost its slot to the last
// (its backward is refused by name) and the other three, in reused slots, again give their own
// bits. With a shared expert and the shared workspace (x staged again per backward), for the
// automatic activation budget (every row saved here), 2944 saved rows (a window cut at the
// budget) and none (FC1 recomputed for every row).
class LayerSavedForwards : public ::testing::TestWithParam<int64_t> {};

struct AloneRun {
  std::vector<mok::bf16> out;
  std::vector<std::vector<float>> grads;
};

AloneRun run_alone(const mok::LayerShape& shape, const mok::Config& cfg, const mok::Workload& wl) {
  auto group = ranks_on_gpus(1, shape, cfg);
  RankData d(shape, wl, 0);
  RankGrads gr(shape, 0);
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  mok::Layer layer(group[0], shape, cfg, d.dw);
  AloneRun r;
  r.out = d.forward_once(layer, group[0]);
  gr.poison();
  layer.backward(d.refs, mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H}), gr.g, group[0].stream());
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(group[0].stream()));
  layer.check();
  r.grads = gr.fetch();
  cudaFree(d_out);
  return r;
}

TEST_P(LayerSavedForwards, MicrobatchesAliveAtOnceGiveTheirOwnBits) {
  MOK_REQUIRE_GPUS(1);
  const mok::LayerShape shape{{1024}, 1024, 384, 32, 8, 256};
  mok::Config cfg;
  cfg.minibatch_tokens = 256;
  cfg.macrobatch_tokens = 512;
  cfg.share_workspace = true;
  cfg.activation_budget_bytes = GetParam();
  constexpr int kBatches = 4;
  std::vector<mok::Workload> wls;
  const mok::Routing routings[kBatches] = {mok::Routing::Uniform, mok::Routing::Zipf, mok::Routing::OneExpert,
                                           mok::Routing::Uniform};
  for (int b = 0; b < kBatches; ++b) {
    wls.push_back(mok::make_workload(shape, routings[b], 500 + uint64_t(b)));
    if (b > 0) wls.back().weights = wls.front().weights;  // one layer: the same weights
  }
  std::vector<AloneRun> want;
  for (int b = 0; b < kBatches; ++b) want.push_back(run_alone(shape, cfg, wls[size_t(b)]));
  mok::Config many = cfg;
  many.saved_forwards = 3;
  auto group = ranks_on_gpus(1, shape, many);
  mok::comm::Communicator& comm = group[0];
  std::vector<std::unique_ptr<RankData>> data;
  std::vector<mok::bf16*> d_outs;
  for (int b = 0; b < kBatches; ++b) {
    data.push_back(std::make_unique<RankData>(shape, wls[size_t(b)], 0));
    d_outs.push_back(upload(wls[size_t(b)].d_out[0].data(), wls[size_t(b)].d_out[0].size()));
  }
  mok::Layer layer(comm, shape, many, data[0]->dw);
  const auto& names = mok::test::kGradNames;
  const auto forward = [&](int b) {
    data[size_t(b)]->poison();
    return layer.forward(data[size_t(b)]->refs, data[size_t(b)]->out_ref(), comm.stream());
  };
  const auto backward_matches = [&](int b, int64_t id) {
    SCOPED_TRACE(testing::Message() << "microbatch " << b << ", forward " << id);
    RankGrads gr(shape, 0);
    gr.poison();
    const auto dref =
        mok::TensorRef::contiguous(d_outs[size_t(b)], mok::DType::BF16, {data[size_t(b)]->T, shape.hidden});
    layer.backward(data[size_t(b)]->refs, dref, gr.g, comm.stream(), id);
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
    layer.check();
    const auto got = gr.fetch();
    for (size_t o = 0; o < got.size(); ++o) {
      int64_t differ = 0;
      for (size_t i = 0; i < got[o].size(); ++i)
        differ += std::memcmp(&got[o][i], &want[size_t(b)].grads[o][i], sizeof(float)) != 0;
      EXPECT_EQ(differ, 0) << names[o] << " differs from the layer run on the microbatch alone";
    }
  };
  std::vector<int64_t> ids;
  for (int b = 0; b < 3; ++b) ids.push_back(forward(b));
  ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
  layer.check();
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 2}));
  for (int b = 0; b < 3; ++b) EXPECT_EQ(bit_diffs(data[size_t(b)]->result(), want[size_t(b)].out), 0) << "out " << b;
  for (int b = 2; b >= 0; --b) backward_matches(b, ids[size_t(b)]);
  // Forwards 3..6 of microbatches 0..3: forward 3's slot is forward 6's by now.
  ids.clear();
  for (int b = 0; b < kBatches; ++b) ids.push_back(forward(b));
  ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
  RankGrads gr(shape, 0);
  const auto dref = mok::TensorRef::contiguous(d_outs[0], mok::DType::BF16, {data[0]->T, shape.hidden});
  try {
    layer.backward(data[0]->refs, dref, gr.g, comm.stream(), ids[0]);
    ADD_FAILURE() << "the backward of a forward whose slot was taken was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "backward.forward_id") << e.what();
  }
  for (int b = kBatches - 1; b >= 1; --b) backward_matches(b, ids[size_t(b)]);
  for (mok::bf16* p : d_outs) cudaFree(p);
}

// 4I = 1536 bytes per gate/up row: the automatic budget (all rows here), 2944 rows, none.
INSTANTIATE_TEST_SUITE_P(Budgets, LayerSavedForwards, ::testing::Values(int64_t(-1), int64_t(2944 * 1536), int64_t(0)),
                         [](const auto& i) {
                           return std::string(i.param < 0 ? "automatic" : i.param == 0 ? "recompute" : "part");
                         });

// Every rank must run the backward of the same forward (collective): rank 0 runs the first
// forward's, rank 1 the second's (2 GPUs, saved_forwards 2). Each compares the others' forward id
// after the backward's first barrier: check() names backward.forward_id on both ranks.
TEST(LayerSavedForwards2, RanksOnDifferentForwardsAreNamed) {
  MOK_REQUIRE_GPUS(2);
  const mok::LayerShape shape{{512, 512}, 1024, 384, 32, 8, 0};
  mok::Config cfg;
  cfg.minibatch_tokens = 256;
  cfg.macrobatch_tokens = 512;
  cfg.saved_forwards = 2;
  const auto wl = mok::make_workload(shape, mok::Routing::Uniform, 77);
  auto group = two_ranks(shape, cfg);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    RankGrads gr(shape, static_cast<int>(r));
    mok::bf16* d_out = upload(wl.d_out[r].data(), wl.d_out[r].size());
    mok::Layer layer(comm, shape, cfg, d.dw);
    const int64_t first = layer.forward(d.refs, d.out_ref(), comm.stream());
    const int64_t second = layer.forward(d.refs, d.out_ref(), comm.stream());
    layer.backward(d.refs, mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, shape.hidden}), gr.g,
                   comm.stream(), r == 0 ? first : second);
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
    try {
      layer.check();
      ADD_FAILURE() << "rank " << r << ": backwards of different forwards across ranks were not named";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), "backward.forward_id") << e.what();
    }
    cudaFree(d_out);
  });
}

// Eight layers alive on one communicator sharing their workspace (Config::share_workspace): all
// forwards, then the backwards in reverse order. Every layer's gradients are bitwise those of the
// same layer run alone, and the device memory they take is the plan's: 8 x the per-layer bytes +
// the workspace once (within 2%), their symmetric windows (the workspace's x, combine, d_out and
// router-weight windows among them) taken from the communicator's pool (8 layers built, run and
// destroyed first fill it). With a shared expert; resident backward (the
// default ring) and the backward over windows (whose rings, gu and carries are in the workspace
// too; the saved gate/up rows per layer). The GPU must be ours alone (free memory is read).
class LayerMemoryWorkspace : public ::testing::TestWithParam<bool> {};

TEST_P(LayerMemoryWorkspace, EightLayersShareItWithTheSameBits) {
  MOK_REQUIRE_GPUS(1);
  const bool windows = GetParam();
  constexpr int kLayers = 8;
  const mok::LayerShape shape{{1024}, 1024, 384, 32, 8, 256};
  mok::Config cfg;
  cfg.share_workspace = true;
  if (windows) {
    cfg.minibatch_tokens = 256;
    cfg.macrobatch_tokens = 512;
  }
  std::vector<mok::Workload> wls;
  for (int l = 0; l < kLayers; ++l) wls.push_back(mok::make_workload(shape, mok::Routing::Zipf, 300 + uint64_t(l)));
  // Each layer alone (its own communicator, nothing shared): the bits to match.
  mok::Config alone = cfg;
  alone.share_workspace = false;
  std::vector<std::vector<std::vector<float>>> want;
  for (int l = 0; l < kLayers; ++l) want.push_back(grads_of(shape, alone, wls[size_t(l)], 1));
  int sms = 0;
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const mok::MemoryPlan plan = mok::plan_memory(shape, cfg, 0, sms);
  ASSERT_GT(plan.workspace(), 0);
  auto group = ranks_on_gpus(1, shape, cfg);
  mok::comm::Communicator& comm = group[0];
  std::vector<std::unique_ptr<RankData>> data;
  std::vector<std::unique_ptr<RankGrads>> grads;
  std::vector<mok::bf16*> d_outs;
  for (int l = 0; l < kLayers; ++l) {
    data.push_back(std::make_unique<RankData>(shape, wls[size_t(l)], 0));
    grads.push_back(std::make_unique<RankGrads>(shape, 0));
    d_outs.push_back(upload(wls[size_t(l)].d_out[0].data(), wls[size_t(l)].d_out[0].size()));
  }
  const auto run_all = [&](std::vector<std::unique_ptr<mok::Layer>>& layers) {
    for (int l = 0; l < kLayers; ++l) data[size_t(l)]->forward_once(*layers[size_t(l)], comm);
    for (int l = kLayers - 1; l >= 0; --l) {
      const auto dref = mok::TensorRef::contiguous(d_outs[size_t(l)], mok::DType::BF16, {data[0]->T, data[0]->H});
      grads[size_t(l)]->poison();
      layers[size_t(l)]->backward(data[size_t(l)]->refs, dref, grads[size_t(l)]->g, comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      layers[size_t(l)]->check();
    }
  };
  {  // warm-up: the windows of 8 layers into the communicator's pool, the kernels loaded
    std::vector<std::unique_ptr<mok::Layer>> warm;
    for (int l = 0; l < kLayers; ++l) warm.push_back(std::make_unique<mok::Layer>(comm, shape, cfg, data[size_t(l)]->dw));
    run_all(warm);
  }
  size_t free0 = 0, free1 = 0, total = 0;
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(cudaSuccess, cudaMemGetInfo(&free0, &total));
  {
    std::vector<std::unique_ptr<mok::Layer>> layers;
    for (int l = 0; l < kLayers; ++l) layers.push_back(std::make_unique<mok::Layer>(comm, shape, cfg, data[size_t(l)]->dw));
    run_all(layers);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    ASSERT_EQ(cudaSuccess, cudaMemGetInfo(&free1, &total));
    for (int l = 0; l < kLayers; ++l) {
      const auto got = grads[size_t(l)]->fetch();
      for (size_t o = 0; o < got.size(); ++o) {
        int64_t differ = 0;
        for (size_t i = 0; i < got[o].size(); ++i)
          differ += std::memcmp(&got[o][i], &want[size_t(l)][o][i], sizeof(float)) != 0;
        EXPECT_EQ(differ, 0) << "layer " << l << ": gradient " << o << " differs from the layer alone";
      }
    }
  }
  const double measured = double(free0) - double(free1);
  // The symmetric windows (the layers' own and the workspace's) come from the pool: not counted.
  double own = 0, shared = 0;
  for (const mok::BufferBytes& b : plan.buffers)
    if (!b.symmetric) (b.workspace ? shared : own) += double(b.bytes);
  const double planned = double(kLayers) * own + shared;
  std::printf("[layer memory] workspace, %s: %d layers measured %.1f MB, planned %.1f MB (%d x %.1f + workspace "
              "%.1f, symmetric windows from the pool)\n",
              windows ? "windows" : "resident", kLayers, measured * 1e-6, planned * 1e-6, kLayers, own * 1e-6,
              shared * 1e-6);
  EXPECT_NEAR(measured, planned, 0.02 * planned + 16e6);
  for (mok::bf16* p : d_outs) cudaFree(p);
}

INSTANTIATE_TEST_SUITE_P(Backward, LayerMemoryWorkspace, ::testing::Values(false, true),
                         [](const auto& i) { return std::string(i.param ? "windows" : "resident"); });

}  // namespace
