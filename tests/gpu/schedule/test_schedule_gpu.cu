// GPU schedule == CPU twin, bit for bit; graph capture + replay; invalid ids -> named error.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/device_error.h"
#include "gpu_test_util.h"
#include "mok/errors.hpp"
#include "mok/schedule.hpp"
#include "mok/workload.hpp"
#include "schedule/schedule_gpu.h"

namespace {

using mok::test::download;
using mok::test::upload;

std::vector<std::span<const int32_t>> spans(const mok::Workload& wl) {
  std::vector<std::span<const int32_t>> s;
  for (const auto& in : wl.inputs) s.emplace_back(in.topk_idx);
  return s;
}

// Compares a built GPU schedule with the CPU twin's table, field by field.
void expect_same(const mok::gpu::ScheduleView& v, const mok::ScheduleTable& c, const mok::Config& cfg,
                 const mok::LayerShape& shape) {
  const int64_t e_loc = c.local_experts, W = c.world;
  const auto totals = download(v.totals, 1)[0];
  ASSERT_EQ(totals.total_rows, c.total_rows);
  EXPECT_EQ(totals.total_tiles, c.total_rows / 128);
  EXPECT_EQ(totals.num_minibatches, (c.total_rows + cfg.resolved_minibatch(shape) - 1) / cfg.resolved_minibatch(shape));
  EXPECT_EQ(totals.num_macrobatches, (c.total_rows + cfg.resolved_macrobatch(shape) - 1) / cfg.resolved_macrobatch(shape));
  EXPECT_EQ(download(v.counts, e_loc * W), c.counts);
  EXPECT_EQ(download(v.expert_rows, e_loc), c.expert_rows);
  EXPECT_EQ(download(v.expert_offset, e_loc + 1), c.expert_offset);
  EXPECT_EQ(download(v.src_rank, c.total_rows), c.src_rank);
  EXPECT_EQ(download(v.src_slot, c.total_rows), c.src_slot);
  auto tiles = download(v.tile_expert, v.capacity_rows / 128);
  EXPECT_EQ(std::vector<int32_t>(tiles.begin(), tiles.begin() + c.total_rows / 128), c.tile_expert);
  for (size_t t = c.total_rows / 128; t < tiles.size(); ++t) ASSERT_EQ(tiles[t], -1) << "tile " << t;
}

struct Case {
  const char* name;
  std::vector<int64_t> tokens;
  int64_t experts, top_k;
  mok::Routing routing;
};

class ScheduleGpu : public ::testing::TestWithParam<Case> {};

// W simulated ranks on one GPU: every published table lives in this GPU's memory.
TEST_P(ScheduleGpu, MatchesCpuTwinBitForBit) {
  MOK_REQUIRE_GPUS(1);
  const Case& c = GetParam();
  mok::LayerShape shape;
  shape.tokens = c.tokens;
  shape.hidden = 64;
  shape.intermediate = 64;
  shape.experts = c.experts;
  shape.top_k = c.top_k;
  const auto wl = mok::make_workload(shape, c.routing, 4242);
  const int W = shape.world_size();
  std::vector<int32_t*> tables;
  for (const auto& in : wl.inputs) tables.push_back(upload(in.topk_idx));
  const int32_t* const* d_tables = upload(std::vector<const int32_t*>(tables.begin(), tables.end()));
  mok::Config cfg;
  cfg.minibatch_tokens = 256;
  for (int d = 0; d < W; ++d) {
    SCOPED_TRACE("rank " + std::to_string(d));
    mok::gpu::ScheduleBuilder b(shape, cfg, d, d_tables);
    b.build(nullptr);
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    expect_same(b.view(), mok::build_schedule_cpu(shape, d, spans(wl)), cfg, shape);
    // Bitwise identical when built again.
    const auto first = download(b.view().src_slot, b.view().capacity_rows);
    b.build(nullptr);
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(download(b.view().src_slot, b.view().capacity_rows), first);
  }
  for (auto* t : tables) cudaFree(t);
  cudaFree(const_cast<const int32_t**>(d_tables));
}

INSTANTIATE_TEST_SUITE_P(
    Routings, ScheduleGpu,
    ::testing::Values(
        Case{"dsv3_ep2_uniform", {8192, 8192}, 256, 8, mok::Routing::Uniform},
        Case{"dsv3_ep2_zipf", {8192, 8192}, 256, 8, mok::Routing::Zipf},
        Case{"ep4_eloc64_zipf_uneven", {4096, 100, 0, 3000}, 256, 8, mok::Routing::Zipf},
        Case{"ep8_k16_empty_slots", {1000, 0, 513, 2048, 1, 77, 4000, 64}, 64, 16, mok::Routing::EmptySlots},
        Case{"ep1_t32768_one_expert", {32768}, 64, 8, mok::Routing::OneExpert},
        Case{"ep2_t32768_one_rank", {32768, 32768}, 128, 8, mok::Routing::OneRank},
        Case{"ep8_one_rank", {512, 512, 512, 512, 512, 512, 512, 512}, 256, 8, mok::Routing::OneRank},
        // More local experts than the offsets kernel's 1024 threads: its scan runs in two chunks.
        Case{"ep1_e1200_zipf", {6000}, 1200, 8, mok::Routing::Zipf}),
    [](const auto& p) { return std::string(p.param.name); });

// Two GPUs: each builds its table reading the peer's published routing over NVLink.
TEST(ScheduleGpuPeers, TwoGpusReadPeerTables) {
  MOK_REQUIRE_GPUS(2);
  const auto shape = mok::LayerShape::uniform(2, 8192, 64, 64, 256, 8);
  const auto wl = mok::make_workload(shape, mok::Routing::Zipf, 17);
  std::vector<int32_t*> tables(2);
  for (int g = 0; g < 2; ++g) {
    MOK_ASSERT_CUDA(cudaSetDevice(g));
    const cudaError_t e = cudaDeviceEnablePeerAccess(1 - g, 0);
    ASSERT_TRUE(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) << cudaGetErrorString(e);
    (void)cudaGetLastError();
    tables[g] = upload(wl.inputs[g].topk_idx);
  }
  for (int g = 0; g < 2; ++g) {
    MOK_ASSERT_CUDA(cudaSetDevice(g));
    const int32_t* const* d_tables = upload(std::vector<const int32_t*>{tables[0], tables[1]});
    mok::Config cfg;
    mok::gpu::ScheduleBuilder b(shape, cfg, g, d_tables);
    b.build(nullptr);
    MOK_ASSERT_CUDA(cudaDeviceSynchronize());
    expect_same(b.view(), mok::build_schedule_cpu(shape, g, spans(wl)), cfg, shape);
    cudaFree(const_cast<const int32_t**>(d_tables));
  }
  for (int g = 0; g < 2; ++g) {
    cudaSetDevice(g);
    cudaFree(tables[g]);
  }
  cudaSetDevice(0);
}

// Publish (int64 ids) + build captured once in a CUDA graph, replayed with new routing.
TEST(ScheduleGpuGraph, CaptureAndReplayWithNewRouting) {
  MOK_REQUIRE_GPUS(1);
  const auto shape = mok::LayerShape::uniform(2, 3000, 64, 64, 32, 4);
  const int64_t n = 3000 * 4;
  std::vector<int64_t*> inputs(2);
  std::vector<int32_t*> published(2);
  for (int r = 0; r < 2; ++r) {
    MOK_ASSERT_CUDA(cudaMalloc(&inputs[r], n * sizeof(int64_t)));
    MOK_ASSERT_CUDA(cudaMalloc(&published[r], n * sizeof(int32_t)));
  }
  const int32_t* const* d_tables = upload(std::vector<const int32_t*>{published[0], published[1]});
  mok::Config cfg;
  mok::gpu::ScheduleBuilder b(shape, cfg, 1, d_tables);
  mok::DeviceErrorWord err;
  cudaStream_t s;
  MOK_ASSERT_CUDA(cudaStreamCreate(&s));
  cudaGraph_t graph;
  MOK_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < 2; ++r)
    mok::gpu::publish_routing(inputs[r], true, nullptr, 3000, 4, 32, r, published[r], err.device(), s);
  b.build(s);
  MOK_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  MOK_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (auto routing : {mok::Routing::Uniform, mok::Routing::Zipf, mok::Routing::EmptySlots}) {
    SCOPED_TRACE(mok::to_string(routing));
    const auto wl = mok::make_workload(shape, routing, 900 + static_cast<int>(routing));
    for (int r = 0; r < 2; ++r) {
      std::vector<int64_t> ids(wl.inputs[r].topk_idx.begin(), wl.inputs[r].topk_idx.end());
      MOK_ASSERT_CUDA(cudaMemcpy(inputs[r], ids.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice));
    }
    MOK_ASSERT_CUDA(cudaGraphLaunch(exec, s));
    MOK_ASSERT_CUDA(cudaStreamSynchronize(s));
    EXPECT_NO_THROW(err.check(4));
    expect_same(b.view(), mok::build_schedule_cpu(shape, 1, spans(wl)), cfg, shape);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  for (int r = 0; r < 2; ++r) {
    cudaFree(inputs[r]);
    cudaFree(published[r]);
  }
  cudaFree(const_cast<const int32_t**>(d_tables));
}

TEST(ScheduleGpuErrors, InvalidIdGivesNamedErrorAndIsNeutralized) {
  MOK_REQUIRE_GPUS(1);
  std::vector<int32_t> ids = {0, 1, 2, 3, 7, 40, -1, 5};  // [4, 2], E = 8: entry [2,1] is bad
  int32_t* d_in = upload(ids);
  int32_t* d_out = upload(std::vector<int32_t>(8, 99));
  mok::DeviceErrorWord err;
  mok::gpu::publish_routing(d_in, false, nullptr, 4, 2, 8, 3, d_out, err.device(), nullptr);
  MOK_ASSERT_CUDA(cudaDeviceSynchronize());
  try {
    err.check(2);
    FAIL() << "expected an error";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "topk_idx[2,1]") << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 3"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(err.check(2));  // cleared after reporting
  EXPECT_EQ(download(d_out, 8), (std::vector<int32_t>{0, 1, 2, 3, 7, -1, -1, 5}));
  cudaFree(d_in);
  cudaFree(d_out);
}

}  // namespace
