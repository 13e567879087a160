// The kernel half of mok_comm_bench (comm_bench.h says why it is a translation unit of its own):
// pull / push bandwidth one way and both ways at once, the latency of a hand-off, and the --probe
// runs (the rate of 1, 2, 4 SMs; NVLink counters around known workloads).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/device.cuh"
#include "comm_bench.h"
#include "common/cuda_check.h"
#include "copy_kernels.cuh"
#include "mok/comm.hpp"
#include "util/bench_util.h"

namespace mc = mok::comm;
namespace mb = mok::bench;

namespace mok::bench::comm_bench {
namespace {

constexpr int kMaxDynSmem = 232448;  // 227 KiB, the sm_90 per-block maximum

struct TmaShape {
  uint32_t rows_per_task, stages, smem;
};
TmaShape tma_shape(uint32_t row_bytes) {
  TmaShape s{};
  s.rows_per_task = std::max(1u, std::min(32u, 32768u / row_bytes));
  const uint32_t stage = s.rows_per_task * row_bytes;
  s.stages = std::min<uint32_t>(64, (kMaxDynSmem - 1024) / stage);
  s.smem = 1024 + s.stages * stage;
  return s;
}

void launch_copy(const std::string& method, int sms, const mb::CopyArgs& a, cudaStream_t s) {
  if (method == "tma") {
    const TmaShape t = tma_shape(a.row_bytes);
    mb::tma_copy_rows<<<sms, mb::kTmaThreads, t.smem, s>>>(a, t.rows_per_task, t.stages);
  } else {
    mb::ldst_copy_rows<><<<sms, mb::kLdstThreads, 120 * 1024, s>>>(a);  // smem only to force 1 CTA/SM
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

unsigned long long check(int device, cudaStream_t s, const void* data, uint32_t rows, uint32_t row_bytes, uint32_t tag,
                         const int* src_idx, const int* dst_idx) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  unsigned long long* bad = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
  MOK_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(*bad), s));
  mb::check_rows<<<528, 512, 0, s>>>(static_cast<const uint32_t*>(data), rows, row_bytes / 4, tag, src_idx, dst_idx,
                                     bad);
  MOK_CUDA_CHECK(cudaGetLastError());
  unsigned long long h = 0;
  MOK_CUDA_CHECK(cudaMemcpyAsync(&h, bad, sizeof(h), cudaMemcpyDeviceToHost, s));
  MOK_CUDA_CHECK(cudaStreamSynchronize(s));
  MOK_CUDA_CHECK(cudaFree(bad));
  return h;
}

void fill(int device, cudaStream_t s, void* data, uint32_t rows, uint32_t row_bytes, uint32_t tag) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  mb::fill_rows<<<528, 512, 0, s>>>(static_cast<uint32_t*>(data), rows, row_bytes / 4, tag);
  MOK_CUDA_CHECK(cudaGetLastError());
  MOK_CUDA_CHECK(cudaStreamSynchronize(s));
}

// NVLink throughput counters summed over the links of GPUs 0 and 1, from
// `nvidia-smi nvlink -gt d` (data payload) or `-gt r` (payload + protocol overhead), in bytes.
struct LinkCounters {
  double tx[2] = {0, 0}, rx[2] = {0, 0};
  int lines = 0;
  std::string first_line;
};
LinkCounters read_links(const char* kind) {
  LinkCounters c;
  const std::string cmd = std::string("nvidia-smi nvlink -gt ") + kind + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return c;
  char line[512];
  int gpu = -1;
  while (std::fgets(line, sizeof(line), p)) {
    const std::string l = line;
    if (c.first_line.empty()) c.first_line = l.substr(0, l.find('\n'));
    if (l.rfind("GPU ", 0) == 0) gpu = std::atoi(l.c_str() + 4);
    for (const char* key : {"Tx:", "Rx:"}) {
      const size_t at = l.find(key);
      if (at == std::string::npos || gpu < 0 || gpu > 1) continue;
      double v = std::atof(l.c_str() + at + 3);
      if (l.find("MiB", at) != std::string::npos) v *= 1024.0;
      const double bytes = v * 1024.0;  // KiB
      (key[0] == 'T' ? c.tx : c.rx)[gpu] += bytes;
      ++c.lines;
    }
  }
  pclose(p);
  return c;
}

}  // namespace

void set_kernel_attributes(int device) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::tma_copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynSmem));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
}

size_t sig_window_bytes() { return mb::kSigWindowBytes; }

std::vector<LinkRow> run_link_probes(mc::LocalGroup& group, const std::vector<RankBuf>& rb, bool full) {
  std::vector<LinkRow> links;
  std::mt19937 link_rng(4242u);
  const uint32_t row_bytes = 2u * 7168u;
  auto& rng = link_rng;
  auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); };
  auto measure_links = [&](const char* name, double payload, const std::function<void()>& work) {
    for (int d = 0; d < 2; ++d) {
      MOK_CUDA_CHECK(cudaSetDevice(d));
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
    }
    settle();
    const LinkCounters d0 = read_links("d"), r0 = read_links("r");
    work();
    for (int d = 0; d < 2; ++d) {
      MOK_CUDA_CHECK(cudaSetDevice(d));
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
    }
    settle();
    const LinkCounters d1 = read_links("d"), r1 = read_links("r");
    if (d1.lines == 0) {
      std::printf("[probe-link] %s: no NVLink counters from nvidia-smi ('%s')\n", name, d1.first_line.c_str());
      return;
    }
    links.push_back({name, payload,
                     {d1.tx[0] - d0.tx[0], d1.rx[0] - d0.rx[0], d1.tx[1] - d0.tx[1], d1.rx[1] - d0.rx[1]},
                     {r1.tx[0] - r0.tx[0], r1.rx[0] - r0.rx[0], r1.tx[1] - r0.tx[1], r1.rx[1] - r0.rx[1]}});
    std::printf("[probe-link] %-28s payload %.3f GB | data GPU0 tx %.3f rx %.3f, GPU1 tx %.3f rx %.3f GB | "
                "raw GPU0 tx %.3f rx %.3f, GPU1 tx %.3f rx %.3f GB\n",
                name, payload / 1e9, (d1.tx[0] - d0.tx[0]) / 1e9, (d1.rx[0] - d0.rx[0]) / 1e9,
                (d1.tx[1] - d0.tx[1]) / 1e9, (d1.rx[1] - d0.rx[1]) / 1e9, (r1.tx[0] - r0.tx[0]) / 1e9,
                (r1.rx[0] - r0.rx[0]) / 1e9, (r1.tx[1] - r0.tx[1]) / 1e9, (r1.rx[1] - r0.rx[1]) / 1e9);
  };
  measure_links("idle", 0, [] {});
  const uint32_t big_rows = rows_for(7168);
  for (int r = 0; r < 2; ++r) {
    MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
    fill(rb[r].dev, rb[r].s, rb[r].x_local, big_rows, row_bytes, static_cast<uint32_t>(r));
  }
  const double big = static_cast<double>(big_rows) * row_bytes;
  const mb::CopyArgs bpull{rb[0].x_peer, static_cast<char*>(rb[0].y), rb[0].perm, nullptr, big_rows, row_bytes};
  const mb::CopyArgs bpush{static_cast<const char*>(rb[0].y), rb[0].x_peer, nullptr, rb[0].perm, big_rows, row_bytes};
  std::vector<int> bperm(big_rows);
  std::iota(bperm.begin(), bperm.end(), 0);
  std::shuffle(bperm.begin(), bperm.end(), rng);
  MOK_CUDA_CHECK(cudaSetDevice(0));
  MOK_CUDA_CHECK(cudaMemcpy(rb[0].perm, bperm.data(), sizeof(int) * big_rows, cudaMemcpyHostToDevice));
  for (const char* method : {"ldst", "tma"}) {
    if (!full && std::string(method) == "tma") continue;
    measure_links((std::string("pull ") + method + " 16 SMs x10").c_str(), 10 * big, [&] {
      MOK_CUDA_CHECK(cudaSetDevice(0));
      for (int i = 0; i < 10; ++i) launch_copy(method, 16, bpull, rb[0].s);
    });
    measure_links((std::string("push ") + method + " 16 SMs x10").c_str(), 10 * big, [&] {
      MOK_CUDA_CHECK(cudaSetDevice(0));
      for (int i = 0; i < 10; ++i) launch_copy(method, 16, bpush, rb[0].s);
    });
  }
  for (bool push_mode : {true, false}) {
    const uint32_t hops = 20000;
    measure_links(push_mode ? "hand-off push 1 CTA x20000" : "hand-off pull 1 CTA x20000",
                  static_cast<double>(hops) * mb::kSigBlockBytes, [&] {
      std::vector<unsigned long long*> out(2);
      for (int r = 0; r < 2; ++r) {
        auto& c = group[static_cast<size_t>(r)];
        MOK_CUDA_CHECK(cudaSetDevice(c.device()));
        MOK_CUDA_CHECK(cudaMalloc(&out[r], 5 * sizeof(unsigned long long)));
        MOK_CUDA_CHECK(cudaMemset(out[r], 0, 5 * sizeof(unsigned long long)));
        MOK_CUDA_CHECK(cudaMemset(c.window("sig").ptr, 0, mb::kSigWindowBytes));
        MOK_CUDA_CHECK(cudaDeviceSynchronize());
      }
      for (int r = 0; r < 2; ++r) {
        auto& c = group[static_cast<size_t>(r)];
        MOK_CUDA_CHECK(cudaSetDevice(c.device()));
        const auto dc = mc::dev::make_device_comm(c);
        if (push_mode) {
          mb::signal_pingpong<16, true><<<1, mb::kSigThreads, 0, c.stream()>>>(dc, c.window("sig").handle, 0, hops,
                                                                              out[r], mc::kWaitUserBase + 100);
        } else {
          mb::signal_pingpong<16, false><<<1, mb::kSigThreads, 0, c.stream()>>>(dc, c.window("sig").handle, 0, hops,
                                                                               out[r], mc::kWaitUserBase + 100);
        }
        MOK_CUDA_CHECK(cudaGetLastError());
      }
      for (int r = 0; r < 2; ++r) {
        auto& c = group[static_cast<size_t>(r)];
        c.sync_and_check(c.stream());
        MOK_CUDA_CHECK(cudaSetDevice(c.device()));
        MOK_CUDA_CHECK(cudaFree(out[r]));
      }
    });
  }
  return links;
}

std::vector<SmProbe> run_sm_probes(const std::vector<RankBuf>& rb) {
  std::vector<SmProbe> sm_probes;
  // ---------------------------------------------------------------- per-SM rate probes
  const int hidden = 7168;
  const uint32_t rows = 16384, row_bytes = 2u * hidden;
  const double bytes = static_cast<double>(rows) * row_bytes;
  std::vector<int> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(77u);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int r = 0; r < 2; ++r) {
    MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
    MOK_CUDA_CHECK(cudaMemcpy(rb[r].perm, perm.data(), sizeof(int) * rows, cudaMemcpyHostToDevice));
    fill(rb[r].dev, rb[r].s, rb[r].x_local, rows, row_bytes, static_cast<uint32_t>(r));
  }
  auto time_it = [&](const std::function<void()>& launch) {
    Timer t(0);
    MOK_CUDA_CHECK(cudaSetDevice(0));
    std::vector<double> ms;
    for (int i = 0; i < 4; ++i) {
      MOK_CUDA_CHECK(cudaEventRecord(t.a, rb[0].s));
      launch();
      MOK_CUDA_CHECK(cudaGetLastError());
      MOK_CUDA_CHECK(cudaEventRecord(t.b, rb[0].s));
      MOK_CUDA_CHECK(cudaEventSynchronize(t.b));
      if (i >= 1) ms.push_back(t.ms());
    }
    return bytes / (median(ms) * 1e-3) / 1e9;
  };
  const mb::CopyArgs pull{rb[0].x_peer, static_cast<char*>(rb[0].y), rb[0].perm, nullptr, rows, row_bytes};
  const mb::CopyArgs local{rb[0].x_local, static_cast<char*>(rb[0].y), rb[0].perm, nullptr, rows, row_bytes};
  const mb::CopyArgs push{static_cast<const char*>(rb[0].y), rb[0].x_peer, nullptr, rb[0].perm, rows, row_bytes};
  const TmaShape ts = tma_shape(row_bytes);
  std::printf("[probe] GB/s by SM count and bytes in flight per SM (H=7168, %u rows, GPU0)\n", rows);
  std::printf("[probe] %-34s %9s %9s %9s\n", "variant (in flight per SM)", "1 SM", "2 SM", "4 SM");
  auto row = [&](const char* name, const std::function<void(int)>& launch) {
    std::printf("[probe] %-34s", name);
    SmProbe p{name, {}};
    for (int i = 0; i < 3; ++i) {
      const int nsm = 1 << i;
      p.gbps[i] = time_it([&] { launch(nsm); });
      std::printf(" %9.1f", p.gbps[i]);
    }
    sm_probes.push_back(p);
    std::printf("\n");
  };
  const size_t ldsm = 120 * 1024;
  row("pull ldst unroll 2 (32 KiB)", [&](int n) { mb::ldst_copy_rows<2><<<n, mb::kLdstThreads, ldsm, rb[0].s>>>(pull); });
  row("pull ldst unroll 4 (64 KiB)", [&](int n) { mb::ldst_copy_rows<4><<<n, mb::kLdstThreads, ldsm, rb[0].s>>>(pull); });
  row("pull ldst unroll 8 (128 KiB)", [&](int n) { mb::ldst_copy_rows<8><<<n, mb::kLdstThreads, ldsm, rb[0].s>>>(pull); });
  for (uint32_t st : {2u, 4u, ts.stages}) {
    const std::string name = "pull tma " + std::to_string(st) + " stages (" +
                             std::to_string(st * ts.rows_per_task * row_bytes / 1024) + " KiB)";
    row(name.c_str(), [&](int n) {
      mb::tma_copy_rows<<<n, mb::kTmaThreads, 1024 + st * ts.rows_per_task * row_bytes, rb[0].s>>>(pull, ts.rows_per_task, st);
    });
  }
  row("local gather ldst unroll 8", [&](int n) { mb::ldst_copy_rows<8><<<n, mb::kLdstThreads, ldsm, rb[0].s>>>(local); });
  row("local gather tma max stages", [&](int n) {
    mb::tma_copy_rows<<<n, mb::kTmaThreads, ts.smem, rb[0].s>>>(local, ts.rows_per_task, ts.stages);
  });
  row("push ldst unroll 8", [&](int n) { mb::ldst_copy_rows<8><<<n, mb::kLdstThreads, ldsm, rb[0].s>>>(push); });
  row("push tma max stages", [&](int n) {
    mb::tma_copy_rows<<<n, mb::kTmaThreads, ts.smem, rb[0].s>>>(push, ts.rows_per_task, ts.stages);
  });
  return sm_probes;
}

void measure_bandwidth(const std::vector<RankBuf>& rb, const Args& args, double ceiling, double bidir_each,
                       std::vector<Result>& results, std::vector<Result>& bidir) {
  for (int hidden : kHiddens) {
    const uint32_t rows = rows_for(hidden), row_bytes = 2u * static_cast<uint32_t>(hidden);
    const double bytes = static_cast<double>(rows) * row_bytes;
    std::vector<int> perm(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(1234u + static_cast<uint32_t>(hidden));
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int r = 0; r < 2; ++r) {
      MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
      MOK_CUDA_CHECK(cudaMemcpy(rb[r].perm, perm.data(), sizeof(int) * rows, cudaMemcpyHostToDevice));
      fill(rb[r].dev, rb[r].s, rb[r].x_local, rows, row_bytes, static_cast<uint32_t>(r));
    }
    auto measure = [&](const std::string& mode, const std::string& method, int nsm) {
      // Rank 0 drives; pull gathers from GPU 1, push scatters into GPU 1.
      mb::CopyArgs a{};
      a.rows = rows;
      a.row_bytes = row_bytes;
      if (mode == "pull") {
        a.src = rb[0].x_peer;
        a.dst = static_cast<char*>(rb[0].y);
        a.src_idx = rb[0].perm;
      } else {
        a.src = static_cast<const char*>(rb[0].y);
        a.dst = rb[0].x_peer;
        a.dst_idx = rb[0].perm;
      }
      // Poison the destination, copy once, check every row.
      if (mode == "pull") {
        MOK_CUDA_CHECK(cudaSetDevice(0));
        MOK_CUDA_CHECK(cudaMemsetAsync(rb[0].y, 0xff, bytes, rb[0].s));
      } else {
        MOK_CUDA_CHECK(cudaSetDevice(1));
        MOK_CUDA_CHECK(cudaMemsetAsync(rb[1].x_local, 0xff, bytes, rb[1].s));
        MOK_CUDA_CHECK(cudaStreamSynchronize(rb[1].s));
      }
      MOK_CUDA_CHECK(cudaSetDevice(0));
      launch_copy(method, nsm, a, rb[0].s);
      MOK_CUDA_CHECK(cudaStreamSynchronize(rb[0].s));
      const unsigned long long bad =
          mode == "pull" ? check(0, rb[0].s, rb[0].y, rows, row_bytes, 1, rb[0].perm, nullptr)
                         : check(1, rb[1].s, rb[1].x_local, rows, row_bytes, 0, nullptr, rb[1].perm);
      Timer t(0);
      MOK_CUDA_CHECK(cudaSetDevice(0));
      std::vector<double> ms;
      const int reps = args.quick ? 3 : args.reps;
      for (int i = 0; i < 1 + reps; ++i) {
        MOK_CUDA_CHECK(cudaEventRecord(t.a, rb[0].s));
        launch_copy(method, nsm, a, rb[0].s);
        MOK_CUDA_CHECK(cudaEventRecord(t.b, rb[0].s));
        MOK_CUDA_CHECK(cudaEventSynchronize(t.b));
        if (i >= 1) ms.push_back(t.ms());
      }
      const double m = median(ms);
      Result res{mode, method, hidden, nsm, bytes / (m * 1e-3) / 1e9, m, bad};
      std::printf("[comm_bench] %-4s %-4s H=%-5d SMs=%-2d %8.1f GB/s (%5.1f%% of ceiling) %7.3f ms  wrong words=%llu\n",
                  mode.c_str(), method.c_str(), hidden, nsm, res.gbps, 100.0 * res.gbps / ceiling, m, bad);
      results.push_back(res);
    };
    for (const auto& method : kMethods) {
      for (int nsm : kSmCounts) measure("pull", method, nsm);
    }
    // Both GPUs pull from each other at once (the dispatch pattern with 2 ranks).
    if (hidden == 7168) {
      for (const auto& method : kMethods) {
        for (int nsm : kSmCounts) {
          if (args.quick && nsm != 16) continue;
          Timer t0(0), t1(1);
          Timer* timers[2] = {&t0, &t1};
          std::vector<std::vector<double>> ms(2);
          std::vector<mb::CopyArgs> a(2);
          for (int r = 0; r < 2; ++r) {
            a[r] = mb::CopyArgs{rb[r].x_peer, static_cast<char*>(rb[r].y), rb[r].perm, nullptr, rows, row_bytes};
          }
          const int reps = args.quick ? 3 : args.reps;
          for (int i = 0; i < 1 + reps; ++i) {
            for (int r = 0; r < 2; ++r) {
              MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
              MOK_CUDA_CHECK(cudaEventRecord(timers[r]->a, rb[r].s));
              launch_copy(method, nsm, a[r], rb[r].s);
              MOK_CUDA_CHECK(cudaEventRecord(timers[r]->b, rb[r].s));
            }
            for (int r = 0; r < 2; ++r) {
              MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
              MOK_CUDA_CHECK(cudaEventSynchronize(timers[r]->b));
              if (i >= 1) ms[r].push_back(timers[r]->ms());
            }
          }
          const unsigned long long bad = check(1, rb[1].s, rb[1].y, rows, row_bytes, 0, rb[1].perm, nullptr) +
                                         check(0, rb[0].s, rb[0].y, rows, row_bytes, 1, rb[0].perm, nullptr);
          const double g = std::min(bytes / (median(ms[0]) * 1e-3), bytes / (median(ms[1]) * 1e-3)) / 1e9;
          bidir.push_back({"pull", method, hidden, nsm, g, std::max(median(ms[0]), median(ms[1])), bad});
          std::printf("[comm_bench] pull both ways %-4s H=%-5d SMs=%-2d %8.1f GB/s per GPU (%5.1f%% of the "
                      "two-way memcpy %.1f)  wrong words=%llu\n",
                      method.c_str(), hidden, nsm, g, 100.0 * g / bidir_each, bidir_each, bad);
        }
      }
    }
    fill(rb[0].dev, rb[0].s, rb[0].y, rows, row_bytes, 0);  // push source
    for (const auto& method : kMethods) {
      for (int nsm : kSmCounts) measure("push", method, nsm);
    }
  }
}

std::vector<Lat> measure_latency(mc::LocalGroup& group, const Args& args) {
  std::vector<Lat> lats;
  const uint32_t warm = 200, hops = timed_handoffs(args);
  for (const char* mode : {"push", "pull"}) {
    for (int k : {1, 4, 16}) {
      std::vector<double> us;
      Lat l{mode, k, 0, 0, 0, 0, 0, warm + hops};
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<unsigned long long*> out(2);
        for (int r = 0; r < 2; ++r) {
          auto& c = group[static_cast<size_t>(r)];
          MOK_CUDA_CHECK(cudaSetDevice(c.device()));
          MOK_CUDA_CHECK(cudaMalloc(&out[r], 5 * sizeof(unsigned long long)));
          MOK_CUDA_CHECK(cudaMemsetAsync(out[r], 0, 5 * sizeof(unsigned long long), c.stream()));
          MOK_CUDA_CHECK(cudaMemsetAsync(c.window("sig").ptr, 0, mb::kSigWindowBytes, c.stream()));
          if (r == 0) {
            mb::sig_init<<<64, 256, 0, c.stream()>>>(static_cast<uint32_t*>(c.window("sig").ptr),
                                                    mb::kSigBlockBytes / 4);
          }
          MOK_CUDA_CHECK(cudaStreamSynchronize(c.stream()));
        }
        group.run([](mc::Communicator& c, size_t) { c.host_barrier(); });
        for (int r = 0; r < 2; ++r) {
          auto& c = group[static_cast<size_t>(r)];
          MOK_CUDA_CHECK(cudaSetDevice(c.device()));
          const auto dc = mc::dev::make_device_comm(c);
          const ncclWindow_t w = c.window("sig").handle;
          const uint32_t id = mc::kWaitUserBase + 100;
          const bool push = std::string(mode) == "push";
          if (k == 1) {
            if (push) mb::signal_pingpong<16, true><<<1, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
            else mb::signal_pingpong<16, false><<<1, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
          } else if (k == 4) {
            if (push) mb::signal_pingpong<4, true><<<4, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
            else mb::signal_pingpong<4, false><<<4, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
          } else {
            if (push) mb::signal_pingpong<1, true><<<16, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
            else mb::signal_pingpong<1, false><<<16, mb::kSigThreads, 0, c.stream()>>>(dc, w, warm, hops, out[r], id);
          }
          MOK_CUDA_CHECK(cudaGetLastError());
        }
        std::vector<std::vector<unsigned long long>> h(2, std::vector<unsigned long long>(5));
        for (int r = 0; r < 2; ++r) {
          auto& c = group[static_cast<size_t>(r)];
          c.sync_and_check(c.stream());
          MOK_CUDA_CHECK(cudaSetDevice(c.device()));
          MOK_CUDA_CHECK(cudaMemcpy(h[r].data(), out[r], 5 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
          MOK_CUDA_CHECK(cudaFree(out[r]));
        }
        us.push_back(static_cast<double>(h[0][0]) * 1e-3 / hops);
        l.bad += h[0][1] + h[1][1];
        l.stored = h[0][2] + h[1][2];
        l.loaded = h[0][3] + h[1][3];
        l.flags = h[0][4] + h[1][4];
      }
      l.us = median(us);
      std::printf("[comm_bench] hand-off of a 256x256 bf16 block, %s with %2d CTA(s): %7.2f us  (runs:", mode, k, l.us);
      for (double u : us) std::printf(" %.2f", u);
      std::printf(")  wrong words=%llu\n", l.bad);
      lats.push_back(l);
    }
  }
  return lats;
}

}  // namespace mok::bench::comm_bench
