// The backward's GEMM program (Config::backward_path fused, src/megakernel/backward_program.h):
// its gradients are bitwise the unfused backward's (the same tiles in the same K order; only the
// order in which tiles run differs: every ticket order is run), on the resident backward and over windows of a small ring
// (saved gate/up rows, part of them, FC1 recomputed), for uniform, Zipf and one-expert routing with
// a shared expert; repeated runs are bitwise identical; forward + backward (fused, and unfused
// over windows: the side stream's fork / join) are captured in one CUDA graph and replayed with
// the same bits. One GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "layer_test_util.h"
#include "mok/comm.hpp"
#include "mok/layer.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::expect_same_bits;
using mok::test::grads_of;
using mok::test::RankData;
using mok::test::RankGrads;
using mok::test::ranks_on_gpus;
using mok::test::upload;

struct ProgramCase {
  const char* name;
  mok::Routing routing;
  int64_t ring;          // Config::macrobatch_tokens (0: the worst case, a resident backward)
  int64_t budget_bytes;  // Config::activation_budget_bytes (windows only)
};
class LayerBackwardProgram : public ::testing::TestWithParam<ProgramCase> {};

TEST_P(LayerBackwardProgram, BitwiseTheUnfusedBackward) {
  MOK_REQUIRE_GPUS(1);
  const ProgramCase& c = GetParam();
  // 16 experts of I = 256 over 1536 tokens, top 4: ~384 rows per expert (three M tiles, the last
  // partial), H = 1024: 4 D1 and 1 D2 N tiles, 8 x 1 WD and 4 x 4 W1 tiles per expert.
  const mok::LayerShape shape{{1536}, 1024, 256, 16, 4, 256};
  const auto wl = mok::make_workload(shape, c.routing, 91);
  mok::Config unfused;
  unfused.minibatch_tokens = 128;
  unfused.macrobatch_tokens = c.ring;
  unfused.activation_budget_bytes = c.budget_bytes;
  mok::Config fused = unfused;
  fused.backward_path = mok::BackwardPath::Fused;
  const auto want = grads_of(shape, unfused, wl, 1);
  // The unfused backward with its weight gradients on the caller's stream (MOK_BWD_STREAMS=0)
  // instead of the side stream: the same bits.
  {
    const mok::test::ScopedEnv one_stream("MOK_BWD_STREAMS", "0");
    expect_same_bits(want, grads_of(shape, unfused, wl, 1), std::string(c.name) + " one stream");
  }
  {  // the pushes beside the weight gradients (the EP > 1 default) at EP 1: the same bits
    const mok::test::ScopedEnv pushes_beside("MOK_BWD_PUSH_BESIDE", "1");
    expect_same_bits(want, grads_of(shape, unfused, wl, 1), std::string(c.name) + " pushes beside");
  }
  {  // the d_x rows stored into their slots by FC1's dgrad (gemm::plan_dgrad_scatter), alone and
     // with the pushes beside: the same bits
    const mok::test::ScopedEnv scatter("MOK_DX_SCATTER", "1");
    expect_same_bits(want, grads_of(shape, unfused, wl, 2), std::string(c.name) + " d_x scatter");
    const mok::test::ScopedEnv pushes_beside("MOK_BWD_PUSH_BESIDE", "1");
    expect_same_bits(want, grads_of(shape, unfused, wl, 1), std::string(c.name) + " d_x scatter, pushes beside");
  }
  {  // only the windows up to the routed rows (MOK_BWD_SYNC_WINDOWS=1, a measurement knob: the host
     // waits for the row count; the last window issued owns the empty experts), and the wait alone
     // (2): the same bits
    const mok::test::ScopedEnv sync("MOK_BWD_SYNC_WINDOWS", "1");
    expect_same_bits(want, grads_of(shape, unfused, wl, 1), std::string(c.name) + " windows up to the rows");
    expect_same_bits(want, grads_of(shape, fused, wl, 1), std::string(c.name) + " windows up to the rows, program");
    const mok::test::ScopedEnv wait_only("MOK_BWD_SYNC_WINDOWS", "2");
    expect_same_bits(want, grads_of(shape, unfused, wl, 1), std::string(c.name) + " the row count's wait alone");
  }
  // Every ticket order (MOK_BWD_ORDER, read when a layer is built), three backwards each: bitwise
  // equal to each other and to the unfused backward.
  for (const char* order : {"phased", "merged", "static"}) {
    setenv("MOK_BWD_ORDER", order, 1);
    const auto got = grads_of(shape, fused, wl, 3);
    expect_same_bits(want, got, std::string(c.name) + " " + order);
  }
  unsetenv("MOK_BWD_ORDER");
  std::printf("[backward program] %s: ring %lld of %lld worst-case rows\n", c.name,
              (long long)(c.ring ? c.ring : shape.worst_case_rows()), (long long)shape.worst_case_rows());
}

// 4I = 1024 bytes per gate/up row: 2944 rows cut a window of 256 and one of 384 rows.
constexpr int64_t kAll = int64_t(1) << 40, kPart = 2944 * 1024;
INSTANTIATE_TEST_SUITE_P(
    Backwards, LayerBackwardProgram,
    ::testing::Values(ProgramCase{"resident_uniform", mok::Routing::Uniform, 0, -1},
                      ProgramCase{"resident_zipf", mok::Routing::Zipf, 0, -1},
                      ProgramCase{"resident_one_expert", mok::Routing::OneExpert, 0, -1},
                      ProgramCase{"windows_uniform_saved", mok::Routing::Uniform, 256, kAll},
                      ProgramCase{"windows_zipf_part", mok::Routing::Zipf, 384, kPart},
                      ProgramCase{"windows_one_expert_recompute", mok::Routing::OneExpert, 512, 0}),
    [](const auto& i) { return std::string(i.param.name); });

// Forward + backward in one CUDA graph: each replay gives the eager run's bits.
void capture_and_replay(const mok::Config& cfg) {
  const mok::LayerShape shape{{1536}, 1024, 256, 16, 4, 256};
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 92);
  auto group = ranks_on_gpus(1, shape, cfg);
  mok::comm::Communicator& comm = group[0];
  cudaStream_t s = comm.stream();
  RankData d(shape, wl, 0);
  RankGrads gr(shape, 0);
  mok::bf16* d_out = upload(wl.d_out[0].data(), wl.d_out[0].size());
  const auto dref = mok::TensorRef::contiguous(d_out, mok::DType::BF16, {d.T, d.H});
  mok::Layer layer(comm, shape, cfg, d.dw);
  // Eager first: the first backward allocates its buffers (not allowed under capture).
  d.forward_once(layer, comm);
  gr.poison();
  layer.backward(d.refs, dref, gr.g, s);
  ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
  layer.check();
  const auto out = d.result();
  const auto want = gr.fetch();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  layer.forward(d.refs, d.out_ref(), s);
  layer.backward(d.refs, dref, gr.g, s);
  ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(s, &graph));
  ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    d.poison();
    gr.poison();
    ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, s));
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(s));
    layer.check();
    EXPECT_EQ(mok::test::bit_diffs(d.result(), out), 0) << "replay " << rep << ": forward output";
    expect_same_bits(want, gr.fetch(), "graph replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(d_out);
}

TEST(LayerBackwardProgramGraph, ForwardAndBackwardCaptureAndReplay) {
  MOK_REQUIRE_GPUS(1);
  mok::Config cfg;
  cfg.backward_path = mok::BackwardPath::Fused;
  capture_and_replay(cfg);
}

// The unfused backward over windows of a small ring: every window forks its weight gradients onto
// the side stream and joins them (src/megakernel/side_stream.h), which the graph must capture
// as its fork / join.
TEST(LayerBackwardProgramGraph, UnfusedWindowsCaptureAndReplay) {
  MOK_REQUIRE_GPUS(1);
  mok::Config cfg;
  cfg.minibatch_tokens = 128;
  cfg.macrobatch_tokens = 384;
  cfg.activation_budget_bytes = kPart;
  capture_and_replay(cfg);
  // The pushes beside the weight gradients, joined after them, and the EP > 1 default: the pulls
  // a window ahead on a third stream (layer_backward_windows.cu).
  {
    const mok::test::ScopedEnv pushes_beside("MOK_BWD_PUSH_BESIDE", "1");
    capture_and_replay(cfg);
  }
  {  // the d_x rows stored by FC1's dgrad into their slots
    const mok::test::ScopedEnv scatter("MOK_DX_SCATTER", "1");
    capture_and_replay(cfg);
  }
  const mok::test::ScopedEnv ahead("MOK_BWD_PULL_AHEAD", "1");
  capture_and_replay(cfg);
}

}  // namespace
