// Pull dispatch and push combine driven by the GPU schedule, against the CPU twin's table:
// every routed row holds its source token (padding rows zero), every combine slot its row.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megakernel/dispatch.h"
#include "megakernel/reverse.h"
#include "mok/schedule.hpp"
#include "mok/workload.hpp"

namespace {

using mok::test::download;
using mok::test::upload;

// Runs dispatch + combine for every destination rank; `gpu_of(r)` places rank r's buffers.
void run(const mok::LayerShape& shape, mok::Routing routing, int (*gpu_of)(int), int64_t window) {
  const int W = shape.world_size();
  const int64_t H = shape.hidden, k = shape.top_k;
  const auto wl = mok::make_workload(shape, routing, 555);
  std::vector<int32_t*> tables(W);
  std::vector<mok::bf16*> xs(W), combine(W);
  for (int r = 0; r < W; ++r) {
    cudaSetDevice(gpu_of(r));
    tables[r] = upload(wl.inputs[r].topk_idx);
    xs[r] = upload(wl.inputs[r].x);
    std::vector<mok::bf16> poison(shape.tokens_of(r) * k * H, mok::bf16::from_bits(0x7fc1));
    combine[r] = upload(poison);
  }
  std::vector<std::span<const int32_t>> spans;
  for (const auto& in : wl.inputs) spans.emplace_back(in.topk_idx);
  std::vector<std::vector<mok::bf16>> expect_combine(W);
  for (int r = 0; r < W; ++r) expect_combine[r].assign(shape.tokens_of(r) * k * H, mok::bf16::from_bits(0x7fc1));
  mok::Rng rng(9);
  for (int d = 0; d < W; ++d) {
    SCOPED_TRACE("rank " + std::to_string(d));
    cudaSetDevice(gpu_of(d));
    const auto* d_tables = upload(std::vector<const int32_t*>(tables.begin(), tables.end()));
    const auto* d_x = upload(std::vector<const void*>(xs.begin(), xs.end()));
    auto* d_comb = upload(std::vector<void*>(combine.begin(), combine.end()));
    mok::gpu::ScheduleBuilder b(shape, mok::Config{}, d, d_tables);
    b.build(nullptr);
    const auto table = mok::build_schedule_cpu(shape, d, spans);
    const int64_t rows = table.total_rows;
    const int64_t win = window > 0 ? window : std::max<int64_t>(rows, 1);
    mok::bf16* routed = nullptr;
    MOK_ASSERT_CUDA(cudaMalloc(&routed, win * H * 2 + 2));
    for (int64_t b0 = 0; b0 < rows; b0 += win) {  // ring windows
      const int64_t b1 = std::min(rows, b0 + win);
      mok::gpu::MoveArgs a;
      a.schedule = b.view();
      a.hidden = H;
      a.top_k = k;
      a.row_begin = b0;
      a.row_end = b0 + win;
      a.sms = 7;
      MOK_ASSERT_CUDA(cudaMemset(routed, 0xff, win * H * 2));
      mok::gpu::pull_dispatch(a, d_x, routed, nullptr);
      MOK_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto got = download(routed, (b1 - b0) * H);
      int64_t bad = 0;
      for (int64_t row = b0; row < b1; ++row) {
        const int src = table.src_rank[row];
        for (int64_t h = 0; h < H; ++h) {
          const uint16_t want = src < 0 ? 0 : wl.inputs[src].x[(table.src_slot[row] / k) * H + h].bits;
          bad += got[(row - b0) * H + h].bits != want;
        }
      }
      EXPECT_EQ(bad, 0) << "window " << b0;
      // Push random y rows back to the combine slots.
      std::vector<mok::bf16> y((b1 - b0) * H);
      for (auto& v : y) v = mok::bf16(float(rng.normal()));
      MOK_ASSERT_CUDA(cudaMemcpy(routed, y.data(), y.size() * 2, cudaMemcpyHostToDevice));
      mok::gpu::push_combine(a, routed, d_comb, nullptr);
      MOK_ASSERT_CUDA(cudaDeviceSynchronize());
      for (int64_t row = b0; row < b1; ++row) {
        const int src = table.src_rank[row];
        if (src < 0) continue;
        std::memcpy(&expect_combine[src][table.src_slot[row] * H], &y[(row - b0) * H], H * 2);
      }
    }
    cudaFree(routed);
    cudaFree(const_cast<const int32_t**>(d_tables));
    cudaFree(const_cast<const void**>(d_x));
    cudaFree(d_comb);
  }
  for (int r = 0; r < W; ++r) {
    cudaSetDevice(gpu_of(r));
    const auto got = download(combine[r], expect_combine[r].size());
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += got[i].bits != expect_combine[r][i].bits;
    EXPECT_EQ(bad, 0) << "combine buffer of rank " << r;
    cudaFree(tables[r]);
    cudaFree(xs[r]);
    cudaFree(combine[r]);
  }
  cudaSetDevice(0);
}

int same_gpu(int) { return 0; }
int own_gpu(int r) { return r; }

}  // namespace

TEST(Movement, SimulatedRanksOneGpu) {
  MOK_REQUIRE_GPUS(1);
  auto shape = mok::LayerShape::uniform(4, 300, 2048, 64, 16, 4);
  shape.tokens[2] = 0;
  run(shape, mok::Routing::Zipf, same_gpu, -1);
}

TEST(Movement, EmptySlotsAndRingWindows) {
  MOK_REQUIRE_GPUS(1);
  const auto shape = mok::LayerShape::uniform(2, 500, 7168, 64, 8, 4);
  run(shape, mok::Routing::EmptySlots, same_gpu, 256);
}

TEST(Movement, TwoGpusOverNvlink) {
  MOK_REQUIRE_GPUS(2);
  for (int g = 0; g < 2; ++g) {
    cudaSetDevice(g);
    const cudaError_t e = cudaDeviceEnablePeerAccess(1 - g, 0);
    ASSERT_TRUE(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled);
    (void)cudaGetLastError();
  }
  const auto shape = mok::LayerShape::uniform(2, 1024, 7168, 64, 16, 8);
  run(shape, mok::Routing::Uniform, own_gpu, -1);
}

// gpu::window_parts (the backward over windows: every expert's part of a window, then what the
// window holds and carries) against the host spec it implements (schedule_math.h's window_part per
// expert, window_ends, the held-in expert's part starting held_in_rows early): layouts of 8 and 600
// experts (more than the kernel's 256 threads), padded, some empty, walked as the layer walks them
// (rings of 256 to 4096 rows, holds of 0 and 384 rows, the activation budget's end cutting one).
TEST(Movement, WindowPartsMatchTheHostSpec) {
  MOK_REQUIRE_GPUS(1);
  namespace sched = mok::sched;
  for (const int32_t experts : {8, 600}) {
    std::vector<int32_t> rows(static_cast<size_t>(experts)), offset(static_cast<size_t>(experts) + 1, 0);
    for (int32_t e = 0; e < experts; ++e) {
      rows[size_t(e)] = e % 7 == 3 ? 0 : int32_t((int64_t(e) * 7919 + 13) % 400);
      offset[size_t(e) + 1] = offset[size_t(e)] + int32_t(sched::pad_rows(rows[size_t(e)]));
    }
    const int64_t total = offset.back();
    const int64_t words = 2 * int64_t(experts) + sched::kWindowEndWords;
    int32_t* d_rows = upload(rows);
    int32_t* d_offset = upload(offset);
    int32_t* d_parts = upload(std::vector<int32_t>(size_t(words), -7));
    mok::gpu::ScheduleView v{};
    v.expert_rows = d_rows;
    v.expert_offset = d_offset;
    int windows = 0;
    for (const int64_t ring : {int64_t(256), int64_t(1024), int64_t(4096)})
      for (const int64_t hold_rows : {int64_t(0), int64_t(384)})
        for (const int64_t end : {int64_t(0), total / 2 / 128 * 128, total}) {
          int64_t prev_lo = 0;
          for (int64_t lo = 0; lo < total; ++windows) {
            const int64_t hi = sched::window_end(lo, ring, total, end);
            const sched::WindowHold hold{hold_rows, prev_lo, end};
            mok::gpu::window_parts(v, experts, lo, hi, hi == total, d_parts, nullptr, hold);
            MOK_ASSERT_CUDA(cudaDeviceSynchronize());
            std::vector<int32_t> want(static_cast<size_t>(words));
            for (int32_t e = 0; e < experts; ++e) {
              const sched::WindowPart p = sched::window_part(offset[size_t(e)], rows[size_t(e)], lo, hi);
              want[size_t(e)] = int32_t(p.begin);
              want[size_t(experts + e)] = int32_t(p.rows);
            }
            const sched::WindowEnds w = sched::window_ends(offset.data(), rows.data(), experts, lo, hi, hi == total, hold);
            if (w.held_in >= 0) {
              want[size_t(w.held_in)] -= w.held_in_rows;
              want[size_t(experts + w.held_in)] += w.held_in_rows;
            }
            const int32_t tail[] = {w.carry_in, w.carry_out, w.first, w.owned, w.held_out, w.held_out_rows, w.held_out_at};
            std::copy(std::begin(tail), std::end(tail), want.begin() + 2 * experts);
            ASSERT_EQ(download(d_parts, words), want) << experts << " experts, ring " << ring << ", hold " << hold_rows
                                                      << ", end " << end << ", window [" << lo << ", " << hi << ")";
            prev_lo = lo;
            lo = hi;
          }
        }
    EXPECT_GT(windows, 20);
    cudaFree(d_rows);
    cudaFree(d_offset);
    cudaFree(d_parts);
  }
}
