// The GPU layer (megakernel and unfused path) against the CPU reference, on 1 and 2 GPUs: the
// routing cases of the spec, small rings (several macrobatches), comm SM counts and minibatch
// sizes; bitwise identical over repeated runs; CUDA graph capture and replay; the timeout path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <mutex>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "layer_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::as_float;
using mok::test::bit_diffs;
using mok::test::download;
using mok::test::RankData;
using mok::test::RankGrads;
using mok::test::ranks_on_gpus;
using mok::test::rel_err;
using mok::test::two_ranks;
using mok::test::upload;

struct Case {
  const char* name;
  int world;
  std::vector<int64_t> tokens;
  int64_t H, I, E, k, Is;
  mok::Routing routing;
  mok::ForwardPath path = mok::ForwardPath::Megakernel;
  int comm_sms = 8;
  int64_t minibatch = 0, macrobatch = 0;
  int reps = 3;
  mok::CombinePath combine = mok::CombinePath::CommCtas;
  bool clusters = false;
  mok::DispatchPath dispatch = mok::DispatchPath::Pull;
};

// The same case with other execution settings (results must not change).
Case with(Case c, const char* name, mok::ForwardPath path, int comm_sms, int64_t minibatch = 0,
          int64_t macrobatch = 0, int reps = 3) {
  c.name = name;
  c.path = path;
  c.comm_sms = comm_sms;
  c.minibatch = minibatch;
  c.macrobatch = macrobatch;
  c.reps = reps;
  return c;
}

mok::LayerShape shape_of(const Case& c) { return mok::LayerShape{c.tokens, c.H, c.I, c.E, c.k, c.Is}; }

mok::Config config_of(const Case& c) {
  mok::Config cfg;
  cfg.forward_path = c.path;
  cfg.fwd_comm_sms = c.comm_sms;
  cfg.minibatch_tokens = c.minibatch;
  cfg.macrobatch_tokens = c.macrobatch;
  cfg.combine = c.combine;
  cfg.fwd_clusters = c.clusters;
  cfg.dispatch = c.dispatch;
  // Under compute-sanitizer the first launches of a module take seconds (instrumentation), longer
  // than the default bound of a wait: scripts/sanitize.sh raises it with this variable.
  if (const char* t = std::getenv("MOK_TEST_WAIT_TIMEOUT_S")) cfg.wait_timeout_s = std::atof(t);
  return cfg;
}

// Repetitions of a case: MOK_TEST_REPS caps them (scripts/sanitize.sh: every launch is slow under
// the tools, and two repetitions still compare bits run to run).
int reps_of(const Case& c) {
  const char* cap = std::getenv("MOK_TEST_REPS");
  return cap ? std::max(1, std::min(c.reps, std::atoi(cap))) : c.reps;
}

class LayerForward : public ::testing::TestWithParam<Case> {};

TEST_P(LayerForward, MatchesReferenceAndIsBitwiseReproducible) {
  const Case& c = GetParam();
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
  const auto wl = mok::make_workload(shape, c.routing, 31337);
  const auto ref = mok::ref::Engine(shape, cfg).forward(wl.inputs, wl.weights);

  auto group = ranks_on_gpus(c.world, shape, cfg);
  std::mutex m;
  std::vector<double> rel(c.world);
  std::vector<int64_t> diffs(c.world);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    const int64_t T = d.T, H = d.H;
    mok::Layer layer(comm, shape, cfg, d.dw);
    std::vector<mok::bf16> first;
    for (int rep = 0; rep < reps_of(c); ++rep) {
      d.poison();
      layer.forward(d.refs, d.out_ref(), comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      layer.check();
      const std::vector<mok::bf16> got = d.result();
      if (rep == 0) {
        first = got;
        double num = 0, den = 0;
        for (int64_t i = 0; i < T * H; ++i) {
          const double a = float(got[i]), b = float(ref.out[r][i]);
          num += (a - b) * (a - b);
          den += b * b;
          if (std::isnan(a)) num = INFINITY;
        }
        std::lock_guard<std::mutex> lock(m);
        rel[r] = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        diffs[r] = bit_diffs(got, ref.out[r]);
      } else {
        EXPECT_EQ(bit_diffs(got, first), 0) << "rank " << r << " repetition " << rep << " differs from the first";
      }
    }
  });
  for (int r = 0; r < c.world; ++r) {
    std::printf("[layer] %s rank %d: rel err %.2e vs CPU reference, %lld of %lld values differ in bits\n",
                c.name, r, rel[r], (long long)diffs[r], (long long)(shape.tokens_of(r) * c.H));
    EXPECT_LT(rel[r], 1e-2) << "rank " << r;
  }
}

const Case kUniformShared{"ep1_uniform_shared", 1, {700}, 1024, 512, 16, 4, 512, mok::Routing::Uniform};
const Case kZipf{"ep2_zipf", 2, {600, 333}, 1024, 512, 16, 4, 0, mok::Routing::Zipf};
const Case kEmptyShared{"ep2_empty_slots_t0_shared", 2, {512, 0}, 2048, 768, 32, 8, 256, mok::Routing::EmptySlots};
const Case kOneRank{"ep2_one_rank", 2, {400, 400}, 1024, 256, 8, 2, 0, mok::Routing::OneRank};
const Case kOneExpertShared{"ep2_one_expert_shared", 2, {300, 500}, 1024, 512, 16, 4, 512, mok::Routing::OneExpert};
constexpr auto kMk = mok::ForwardPath::Megakernel;
constexpr auto kUnfused = mok::ForwardPath::Unfused;

INSTANTIATE_TEST_SUITE_P(
    Routings, LayerForward,
    ::testing::Values(kUniformShared, kZipf, kEmptyShared, kOneRank, kOneExpertShared,
                      with(kUniformShared, "ep1_uniform_shared_unfused", kUnfused, 8),
                      with(kZipf, "ep2_zipf_unfused", kUnfused, 16),
                      with(kEmptyShared, "ep2_empty_slots_t0_shared_unfused", kUnfused, 8)),
    [](const auto& p) { return std::string(p.param.name); });

// A small ring forces many macrobatches (ring reuse), with minibatches of 1 and 2 tiles.
INSTANTIATE_TEST_SUITE_P(
    Ring, LayerForward,
    ::testing::Values(with(kZipf, "ring_mb128_macro256", kMk, 8, 128, 256),
                      with(kZipf, "ring_mb256_macro512", kMk, 4, 256, 512),
                      with(kOneExpertShared, "ring_one_expert_shared_mb128_macro384", kMk, 8, 128, 384),
                      with(kUniformShared, "ring_ep1_mb128_macro256", kMk, 16, 128, 256)),
    [](const auto& p) { return std::string(p.param.name); });

INSTANTIATE_TEST_SUITE_P(
    CommSms, LayerForward,
    ::testing::Values(with(kZipf, "comm2", kMk, 2), with(kZipf, "comm8", kMk, 8), with(kZipf, "comm16", kMk, 16),
                      with(kZipf, "comm32", kMk, 32)),
    [](const auto& p) { return std::string(p.param.name); });

INSTANTIATE_TEST_SUITE_P(
    Minibatch, LayerForward,
    ::testing::Values(with(kZipf, "mb128", kMk, 8, 128), with(kZipf, "mb384", kMk, 8, 384),
                      with(kZipf, "mb1024", kMk, 8, 1024),
                      with(kOneExpertShared, "bitwise_20_runs", kMk, 8, 256, 0, 20)),
    [](const auto& p) { return std::string(p.param.name); });

// The same case with one more setting changed by `set` (results must not change).
template <typename Set>
Case tweaked(Case c, const char* name, Set set) {
  c.name = name;
  set(c);
  return c;
}
Case epilogue_combine(Case c, const char* name) {
  return tweaked(c, name, [](Case& x) { x.combine = mok::CombinePath::Fc2Epilogue; });
}
Case clustered(Case c, const char* name) {
  return tweaked(c, name, [](Case& x) { x.clusters = true; });
}
Case pushed(Case c, const char* name) {
  return tweaked(c, name, [](Case& x) { x.dispatch = mok::DispatchPath::Push; });
}

// The combine done by the FC2 epilogue (stores straight into the owners' slots).
INSTANTIATE_TEST_SUITE_P(
    EpilogueCombine, LayerForward,
    ::testing::Values(epilogue_combine(kUniformShared, "ep1_uniform_shared"), epilogue_combine(kZipf, "ep2_zipf"),
                      epilogue_combine(kEmptyShared, "ep2_empty_slots_t0_shared"),
                      epilogue_combine(kOneExpertShared, "ep2_one_expert_shared"),
                      epilogue_combine(with(kZipf, "", kMk, 4, 128, 256), "ring_mb128_macro256_comm4")),
    [](const auto& p) { return std::string(p.param.name); });

// 2-CTA clusters: tickets are pairs of M tiles, B multicast when both belong to one expert, a
// dummy tile keeps the pair in step when a minibatch or the shared expert has an odd tile count
// (minibatch 384 = 3 tiles; T = 300/500 shared tokens = 3/4 tiles).
INSTANTIATE_TEST_SUITE_P(
    Clusters, LayerForward,
    ::testing::Values(clustered(kUniformShared, "ep1_uniform_shared"), clustered(kZipf, "ep2_zipf"),
                      clustered(kEmptyShared, "ep2_empty_slots_t0_shared"), clustered(kOneRank, "ep2_one_rank"),
                      clustered(kOneExpertShared, "ep2_one_expert_shared"),
                      clustered(with(kZipf, "", kMk, 2, 384), "mb384_comm2"),
                      clustered(with(kZipf, "", kMk, 8, 128, 256), "ring_mb128_macro256"),
                      clustered(with(kOneExpertShared, "", kMk, 8, 128, 384), "ring_one_expert_shared_mb128_macro384"),
                      clustered(epilogue_combine(kZipf, ""), "epilogue_combine_ep2_zipf"),
                      clustered(with(kOneExpertShared, "", kMk, 8, 256, 0, 20), "bitwise_20_runs")),
    [](const auto& p) { return std::string(p.param.name); });

// Push dispatch: every rank writes its own tokens into the receivers' rings (symmetric windows)
// and counts them there; ring reuse then waits on the receiver's FC2 counters over NVLink.
INSTANTIATE_TEST_SUITE_P(
    PushDispatch, LayerForward,
    ::testing::Values(pushed(kUniformShared, "ep1_uniform_shared"), pushed(kZipf, "ep2_zipf"),
                      pushed(kEmptyShared, "ep2_empty_slots_t0_shared"), pushed(kOneRank, "ep2_one_rank"),
                      pushed(kOneExpertShared, "ep2_one_expert_shared"), pushed(with(kZipf, "", kMk, 2), "comm2"),
                      pushed(with(kZipf, "", kMk, 8, 128, 256), "ring_mb128_macro256"),
                      pushed(with(kOneExpertShared, "", kMk, 4, 128, 384), "ring_one_expert_shared_mb128_macro384_comm4"),
                      pushed(epilogue_combine(kZipf, ""), "epilogue_combine_ep2_zipf"),
                      pushed(clustered(with(kZipf, "", kMk, 8, 128, 256), ""), "clusters_ring_mb128_macro256"),
                      pushed(with(kOneExpertShared, "", kMk, 8, 256, 0, 20), "bitwise_20_runs")),
    [](const auto& p) { return std::string(p.param.name); });

// Push and pull dispatch move the same rows into the same ring positions, so the outputs must
// agree bit for bit; checked on two different inputs in a row (so a count that arrives late or a
// stale ring row from the previous call would show) with a ring small enough to be reused (the
// senders then wait for the receiver's FC2 counters over NVLink), with and without a shared expert.
class LayerForwardDispatch : public ::testing::TestWithParam<Case> {};

TEST_P(LayerForwardDispatch, PushEqualsPullBitwise) {
  const Case c = GetParam();
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  mok::Config pull_cfg = config_of(c), push_cfg = config_of(c);
  pull_cfg.dispatch = mok::DispatchPath::Pull;
  push_cfg.dispatch = mok::DispatchPath::Push;
  const auto wl1 = mok::make_workload(shape, mok::Routing::Zipf, 41);
  const auto wl2 = mok::make_workload(shape, mok::Routing::Uniform, 42);  // other x and routing
  auto group = two_ranks(shape, pull_cfg);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d1(shape, wl1, static_cast<int>(r)), d2(shape, wl2, static_cast<int>(r));
    mok::Layer pull(comm, shape, pull_cfg, d1.dw), push(comm, shape, push_cfg, d1.dw);  // wl1's weights
    for (RankData* d : {&d1, &d2, &d1}) {
      d->poison();
      pull.forward(d->refs, d->out_ref(), comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      pull.check();
      const auto want = d->result();
      d->poison();
      push.forward(d->refs, d->out_ref(), comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      push.check();
      EXPECT_EQ(bit_diffs(d->result(), want), 0) << "rank " << r << (d == &d1 ? ", first inputs" : ", second inputs");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Ring, LayerForwardDispatch,
    ::testing::Values(with(kZipf, "zipf_mb128_macro256_comm4", kMk, 4, 128, 256),
                      with(kOneExpertShared, "shared_mb128_macro384", kMk, 8, 128, 384),
                      with(kEmptyShared, "t0_shared_one_macrobatch", kMk, 8)),
    [](const auto& p) { return std::string(p.param.name); });

// ---------------------------------------------------------------------------------------------
// Backward: gradients against ref::Engine::backward (d_x, d_topk_w, every weight gradient), the
// same bits on a second forward + backward, on 1 and 2 GPUs, after the unfused forward and after
// the megakernel (whose ring holds every routed row by default).
// ---------------------------------------------------------------------------------------------

class LayerBackward : public ::testing::TestWithParam<Case> {};

TEST_P(LayerBackward, MatchesReferenceAndIsBitwiseReproducible) {
  const Case& c = GetParam();
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
  const auto wl = mok::make_workload(shape, c.routing, 4242);
  const auto ref = mok::ref::Engine(shape, cfg).backward(wl.inputs, wl.weights, wl.d_out);
  auto group = ranks_on_gpus(c.world, shape, cfg);
  const char* names[] = {"d_x", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dWs_gate", "dWs_up", "dWs_down"};
  std::mutex m;
  std::vector<std::vector<double>> errs(c.world, std::vector<double>(8, -1.0));
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    RankGrads gr(shape, static_cast<int>(r));
    const int64_t T = d.T, H = c.H, I = c.I, e_loc = shape.local_experts(), Is = c.Is;
    mok::bf16* d_out = upload(wl.d_out[r].data(), wl.d_out[r].size());
    const mok::TensorRef dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {T, H});
    mok::Layer layer(comm, shape, cfg, d.dw);
    std::vector<std::vector<float>> first;
    for (int rep = 0; rep < 2; ++rep) {
      d.forward_once(layer, comm);
      gr.poison();
      layer.backward(d.refs, dref, gr.g, comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      layer.check();
      auto got = gr.fetch();
      if (rep == 1) {
        for (size_t o = 0; o < got.size(); ++o) {
          int64_t differ = 0;
          for (size_t i = 0; i < got[o].size(); ++i)
            differ += std::memcmp(&got[o][i], &first[o][i], sizeof(float)) != 0;
          EXPECT_EQ(differ, 0) << "rank " << r << ": " << names[o] << " differs on the second backward";
        }
        break;
      }
      first = got;
      const int64_t e0 = static_cast<int64_t>(r) * e_loc;
      std::vector<double> e(8, -1.0);
      if (T > 0) {
        e[0] = rel_err(got[0], as_float(ref.d_x[r], 0, T * H).data(), T * H);
        e[1] = rel_err(got[1], ref.d_topk_w[r].data(), T * c.k);
      }
      e[2] = rel_err(got[2], as_float(ref.d_w_gate, e0 * I * H, e_loc * I * H).data(), e_loc * I * H);
      e[3] = rel_err(got[3], as_float(ref.d_w_up, e0 * I * H, e_loc * I * H).data(), e_loc * I * H);
      e[4] = rel_err(got[4], as_float(ref.d_w_down, e0 * H * I, e_loc * H * I).data(), e_loc * H * I);
      if (Is > 0 && T > 0) {
        e[5] = rel_err(got[5], as_float(ref.d_ws_gate[r], 0, Is * H).data(), Is * H);
        e[6] = rel_err(got[6], as_float(ref.d_ws_up[r], 0, Is * H).data(), Is * H);
        e[7] = rel_err(got[7], as_float(ref.d_ws_down[r], 0, H * Is).data(), H * Is);
      }
      std::lock_guard<std::mutex> lock(m);
      errs[r] = e;
    }
    cudaFree(d_out);
  });
  for (int r = 0; r < c.world; ++r) {
    std::string line;
    for (int o = 0; o < 8; ++o) {
      if (errs[r][o] < 0) continue;
      char buf[48];
      std::snprintf(buf, sizeof buf, " %s %.2e", names[o], errs[r][o]);
      line += buf;
      EXPECT_LT(errs[r][o], 1e-2) << "rank " << r << ": " << names[o];
    }
    std::printf("[layer backward] %s rank %d: rel err vs CPU reference:%s\n", c.name, r, line.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, LayerBackward,
    ::testing::Values(with(kUniformShared, "ep1_uniform_shared_unfused", kUnfused, 8),
                      with(kZipf, "ep2_zipf_unfused", kUnfused, 16),
                      with(kEmptyShared, "ep2_empty_slots_t0_shared_unfused", kUnfused, 8),
                      with(kOneRank, "ep2_one_rank_unfused", kUnfused, 8), kUniformShared, kZipf,
                      kOneExpertShared, pushed(kEmptyShared, "ep2_empty_slots_t0_shared_push")),
    [](const auto& p) { return std::string(p.param.name); });

// What backward() cannot run after is named: a forward that did not save gu, and a second
// backward after one forward (the first overwrote gu with d_gu and the combine slots with d_x
// rows). (A megakernel ring below the worst case is accepted: test_layer_memory.cu.)
TEST(LayerBackwardRefuses, UnsavedForwardSecondBackward) {
  Case c = kUniformShared;
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const auto wl = mok::make_workload(shape, c.routing, 7);
  enum Mode { kUnsaved, kSecondBackward };
  const char* what[] = {"an unsaved forward", "a second backward"};
  for (const Mode mode : {kUnsaved, kSecondBackward}) {
    const mok::Config cfg = config_of(c);
    auto group = ranks_on_gpus(1, shape, cfg);
    group.run([&](mok::comm::Communicator& comm, size_t r) {
      RankData d(shape, wl, static_cast<int>(r));
      RankGrads gr(shape, static_cast<int>(r));
      mok::bf16* d_out = upload(wl.d_out[r].data(), wl.d_out[r].size());
      const mok::TensorRef dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, c.H});
      mok::Layer layer(comm, shape, cfg, d.dw);
      d.forward_once(layer, comm, nullptr, /*save_for_backward=*/mode != kUnsaved);
      if (mode == kSecondBackward) {
        layer.backward(d.refs, dref, gr.g, comm.stream());
        ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
        layer.check();
      }
      try {
        layer.backward(d.refs, dref, gr.g, comm.stream());
        ADD_FAILURE() << "backward accepted " << what[mode];
      } catch (const mok::Error& e) {
        EXPECT_EQ(e.argument(), "forward(save_for_backward)") << e.what();
      }
      cudaFree(d_out);
    });
  }
}

// Layers built one after another on one communicator reuse the symmetric windows of the ones
// destroyed before (no growth), and give the same bits on the reused (zeroed) windows; T is not a
// multiple of 128 and there is a shared expert (it reads the x window's padding rows).
TEST(LayerWindows, LaterLayersReuseWindows) {
  Case c = kOneExpertShared;
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
  mok::Config push_cfg = cfg;
  push_cfg.dispatch = mok::DispatchPath::Push;
  const auto wl = mok::make_workload(shape, c.routing, 17);
  auto group = two_ranks(shape, cfg);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    std::vector<mok::bf16> first;
    size_t windows = 0;
    for (int i = 0; i < 4; ++i) {
      mok::Layer layer(comm, shape, i % 2 ? push_cfg : cfg, d.dw);  // push adds ring and counter windows
      if (i == 1) windows = comm.window_count();
      if (i == 3) EXPECT_EQ(comm.window_count(), windows) << "rank " << r << ": the fourth layer registered new windows";
      d.poison();
      layer.forward(d.refs, d.out_ref(), comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      layer.check();
      if (i == 0)
        first = d.result();
      else
        EXPECT_EQ(bit_diffs(d.result(), first), 0) << "rank " << r << ", layer " << i;
    }
  });
}

// The whole forward captured once in a CUDA graph and replayed: the same bits as direct calls,
// also after the inputs changed in place.
class LayerForwardGraph : public ::testing::TestWithParam<mok::DispatchPath> {};

TEST_P(LayerForwardGraph, CaptureAndReplay) {
  Case c = kOneExpertShared;
  c.dispatch = GetParam();
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
  const auto wl = mok::make_workload(shape, c.routing, 7);
  const auto wl2 = mok::make_workload(shape, mok::Routing::Zipf, 8);  // other x and routing
  auto group = two_ranks(shape, cfg);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::Layer layer(comm, shape, cfg, d.dw);
    cudaStream_t s = comm.stream();
    layer.forward(d.refs, d.out_ref(), s);
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
    layer.check();
    const auto direct = d.result();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    layer.forward(d.refs, d.out_ref(), s);
    ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(s, &graph));
    ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      d.poison();
      ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, s));
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
      layer.check();
      EXPECT_EQ(bit_diffs(d.result(), direct), 0) << "rank " << r << " replay " << rep;
    }
    // New inputs in the same buffers: the replay follows them.
    const auto& in2 = wl2.inputs[r];
    ASSERT_EQ(cudaSuccess, cudaMemcpy(d.x, in2.x.data(), in2.x.size() * 2, cudaMemcpyHostToDevice));
    ASSERT_EQ(cudaSuccess, cudaMemcpy(d.idx, in2.topk_idx.data(), in2.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_EQ(cudaSuccess, cudaMemcpy(d.w, in2.topk_w.data(), in2.topk_w.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    // Both ranks must have changed their inputs before either replays (peers pull our x).
    comm.host_barrier();
    ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, s));
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
    layer.check();
    const auto replayed = d.result();
    layer.forward(d.refs, d.out_ref(), s);
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
    layer.check();
    EXPECT_EQ(bit_diffs(replayed, d.result()), 0) << "rank " << r << ": replay with new inputs";
    EXPECT_GT(bit_diffs(replayed, direct), 0) << "rank " << r << ": new inputs did not change the output";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  });
}

INSTANTIATE_TEST_SUITE_P(Dispatch, LayerForwardGraph,
                         ::testing::Values(mok::DispatchPath::Pull, mok::DispatchPath::Push),
                         [](const ::testing::TestParamInfo<mok::DispatchPath>& i) {
                           return std::string(mok::to_string(i.param));
                         });

// Scheduling knobs that must not change a bit (read from the environment when a layer is built):
//   MOK_MK_SPLIT_N   tiles whose tokens fit in their first 64 rows run in split-N form (both
//                    warpgroups on those rows, half of the columns each) or on warpgroup 0 alone;
//   MOK_MK_GROUP_M   raster groups of 1 M tile inside a minibatch's block, or of all of them.
class LayerForwardKnob : public ::testing::TestWithParam<const char*> {};

TEST_P(LayerForwardKnob, SameBitsOnAndOff) {
  const char* knob = GetParam();
  const Case c = kOneExpertShared;
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 99);
  auto group = two_ranks(shape, cfg);
  std::vector<std::vector<mok::bf16>> outs[2];
  std::mutex m;
  struct Unset {
    const char* name;
    ~Unset() { unsetenv(name); }
  } unset_at_exit{knob};
  for (int on = 1; on >= 0; --on) {
    ASSERT_EQ(0, setenv(knob, on ? "1" : "0", 1));
    group.run([&](mok::comm::Communicator& comm, size_t r) {
      RankData d(shape, wl, static_cast<int>(r));
      mok::Layer layer(comm, shape, cfg, d.dw);
      auto got = d.forward_once(layer, comm);
      std::lock_guard<std::mutex> lock(m);
      outs[on].resize(2);
      outs[on][r] = std::move(got);
    });
  }
  for (int r = 0; r < 2; ++r) EXPECT_EQ(bit_diffs(outs[0][r], outs[1][r]), 0) << knob << ", rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Megakernel, LayerForwardKnob, ::testing::Values("MOK_MK_SPLIT_N", "MOK_MK_GROUP_M"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param).substr(7);  // SPLIT_N, GROUP_M
                         });

// Suites run on both paths (megakernel, unfused) with the two-rank shared-expert case.
class OnBothPaths : public ::testing::TestWithParam<mok::ForwardPath> {
 protected:
  const Case c = with(kOneExpertShared, "", GetParam(), 8);
  const mok::LayerShape shape = shape_of(c);
  const mok::Config cfg = config_of(c);
};
std::string path_name(const ::testing::TestParamInfo<mok::ForwardPath>& i) { return mok::to_string(i.param); }

// forward(..., save_for_backward = false) skips the gate/up pre-activations only: the same bits,
// on both paths, with a shared expert, also when the ranks choose differently in one call.
class LayerForwardInference : public OnBothPaths {};

TEST_P(LayerForwardInference, SameBitsWithoutSavedActivations) {
  MOK_REQUIRE_GPUS(c.world);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 7);
  auto group = two_ranks(shape, cfg);
  constexpr bool kSave[3][2] = {{true, true}, {false, false}, {true, false}};  // per pass, per rank
  std::vector<mok::bf16> outs[3][2];
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::Layer layer(comm, shape, cfg, d.dw);
    for (int pass = 0; pass < 3; ++pass)  // each rank writes only its own entries
      outs[pass][r] = d.forward_once(layer, comm, nullptr, kSave[pass][r]);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(outs[0][r].size(), static_cast<size_t>(c.tokens[static_cast<size_t>(r)] * c.H));
    int64_t poisoned = 0;  // the first pass wrote every element (0xffff is the poison)
    for (const mok::bf16& v : outs[0][r]) poisoned += v.bits == 0xffff;
    EXPECT_EQ(poisoned, 0) << "rank " << r;
    for (int pass = 1; pass < 3; ++pass)
      EXPECT_EQ(bit_diffs(outs[0][r], outs[pass][r]), 0) << "pass " << pass << ", rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, LayerForwardInference, ::testing::Values(kMk, kUnfused), path_name);

// x written straight into Layer::input_buffer() (no copy in forward()) gives the same bits as the
// copy, on both paths, with a shared expert (it reads x from that buffer too).
class LayerForwardInputBuffer : public OnBothPaths {};

TEST_P(LayerForwardInputBuffer, SameBitsWithoutTheCopy) {
  MOK_REQUIRE_GPUS(c.world);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 9);
  auto group = two_ranks(shape, cfg);
  std::vector<mok::bf16> copied[2], direct[2];
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::Layer layer(comm, shape, cfg, d.dw);
    copied[r] = d.forward_once(layer, comm);
    void* buf = layer.input_buffer();
    ASSERT_NE(buf, nullptr);
    // Other x bits first (the copy would restore them; the direct path must not need it)...
    ASSERT_EQ(cudaSuccess, cudaMemset(buf, 0, static_cast<size_t>(d.T * d.H) * 2));
    // ...then the real x, written by the caller.
    ASSERT_EQ(cudaSuccess, cudaMemcpy(buf, d.x, static_cast<size_t>(d.T * d.H) * 2, cudaMemcpyDeviceToDevice));
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    comm.host_barrier();  // both ranks' x in place before either forward pulls from the other
    mok::RoutingRefs refs = d.refs;
    refs.x.data = buf;
    direct[r] = d.forward_once(layer, comm, &refs);
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(bit_diffs(copied[r], direct[r]), 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Paths, LayerForwardInputBuffer, ::testing::Values(kMk, kUnfused), path_name);

// One rank never calls forward: the other's first barrier expires; check() names it, the
// megakernel that follows exits at once (the communicator is poisoned), teardown is clean.
TEST(LayerForwardTimeout, MissingPeerIsNamedAndTerminates) {
  Case c = kZipf;
  MOK_REQUIRE_GPUS(c.world);
  const mok::LayerShape shape = shape_of(c);
  mok::Config cfg = config_of(c);
  cfg.wait_timeout_s = 0.5;
  const auto wl = mok::make_workload(shape, c.routing, 5);
  auto group = two_ranks(shape, cfg);
  std::string error;
  int kind = -1;
  double waited = 0;
  std::latch done(2);
  group.run([&](mok::comm::Communicator& comm, size_t r) {
    RankData d(shape, wl, static_cast<int>(r));
    mok::Layer layer(comm, shape, cfg, d.dw);
    if (r == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      layer.forward(d.refs, d.out_ref(), comm.stream());
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(comm.stream()));
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      try {
        layer.check();
      } catch (const mok::Error& e) {
        error = e.what();
        kind = static_cast<int>(e.kind());
      }
    }
    done.arrive_and_wait();  // rank 1 keeps its buffers until rank 0 has finished
  });
  EXPECT_EQ(kind, static_cast<int>(mok::ErrorKind::Timeout)) << error;
  EXPECT_NE(error.find("lsa_barrier"), std::string::npos) << error;
  EXPECT_LT(waited, 10.0);
  std::printf("layer timeout after %.2f s: %s\n", waited, error.c_str());
  group.destroy();
}

}  // namespace
