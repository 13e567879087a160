// mok_comm_bench — pull vs push of token rows over NVLink through NCCL 2.28 symmetric windows,
// against the copy ceiling (cudaMemcpyPeer of 1 GiB, same run), and the signalling latency of a
// 256x256 bf16 hand-off. One process drives GPUs 0 and 1 (mok::comm::LocalGroup).
//
// usage: mok_comm_bench [--out FILE.json] [--commit SHA] [--reps N] [--quick]
//
// GB/s = payload bytes moved from one GPU to the other / median kernel time (1 GB = 1e9 B).
// pull: rank 0's CTAs gather rows x1[perm[i]] from GPU 1's window into y0[i] (GPU 1 idle).
// push: rank 0's CTAs scatter y0[i] into GPU 1's window at x1[perm[i]].
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <thread>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/device.cuh"
#include "common/cuda_check.h"
#include "copy_kernels.cuh"
#include "mok/comm.hpp"
#include "util/peer_copy.h"

namespace mc = mok::comm;
namespace mb = mok::bench;

namespace {

constexpr int kSmCounts[] = {4, 8, 16, 24, 32};
constexpr int kHiddens[] = {7168, 2048};
constexpr size_t kCeilingBytes = mb::kPeerCopyBytes;
constexpr int kMaxDynSmem = 232448;  // 227 KiB, the sm_90 per-block maximum

struct Args {
  std::string out;
  std::string commit = "unknown";
  int reps = 10;
  bool quick = false;
  bool probe = false;  // per-SM and NVLink-counter probes instead of the main bench
};

using mb::median;

uint32_t rows_for(int hidden) { return hidden >= 4096 ? 65536u : 262144u; }  // ~0.94 / 1.07 GB

struct Result {
  std::string mode, method;
  int hidden, sms;
  double gbps, ms;
  unsigned long long bad;
};

// Events belong to a device: record them only on that device's streams.
struct Timer {
  cudaEvent_t a, b;
  explicit Timer(int device) {
    MOK_CUDA_CHECK(cudaSetDevice(device));
    MOK_CUDA_CHECK(cudaEventCreate(&a));
    MOK_CUDA_CHECK(cudaEventCreate(&b));
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  double ms() const {
    float t = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    return t;
  }
};

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

void set_kernel_attributes(int device) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::tma_copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynSmem));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(mb::ldst_copy_rows<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
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

std::string now_utc() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) args.out = argv[++i];
    else if (a == "--commit" && i + 1 < argc) args.commit = argv[++i];
    else if (a == "--reps" && i + 1 < argc) args.reps = std::max(3, std::atoi(argv[++i]));
    else if (a == "--quick") args.quick = true;
    else if (a == "--probe") args.probe = true;
    else {
      std::printf("usage: mok_comm_bench [--out FILE.json] [--commit SHA] [--reps N] [--quick] [--probe]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 2) {
    std::printf("SKIPPED: mok_comm_bench needs 2 GPUs joined by NVLink, %d visible\n", ngpu);
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int sms = prop.multiProcessorCount;
    std::printf("[comm_bench] %d x %s (%d SMs), NCCL %d\n", ngpu, prop.name, sms, NCCL_VERSION_CODE);

    size_t max_bytes = 0;
    for (int h : kHiddens) max_bytes = std::max(max_bytes, static_cast<size_t>(rows_for(h)) * 2 * h);
    mc::CommOptions opts;
    opts.config.wait_timeout_s = 10.0;
    opts.lsa_barrier_count = 32;
    opts.windows = {{"x", max_bytes}, {"sig", mb::kSigWindowBytes}};
    auto group = mc::LocalGroup::create({0, 1}, opts);
    mc::register_wait_name(mc::kWaitUserBase + 100, "bench.signal_pingpong");

    // Per-rank buffers: local rows y, permutation, streams.
    struct RankBuf {
      int dev;
      cudaStream_t s;
      void* y = nullptr;
      int* perm = nullptr;
      char* x_local = nullptr;  // this rank's window (host-side pointer: for fill/check kernels)
      char* x_peer = nullptr;   // the other rank's window as this GPU's kernels reach it
    };
    std::vector<RankBuf> rb(2);
    for (int r = 0; r < 2; ++r) {
      auto& c = group[static_cast<size_t>(r)];
      rb[r].dev = c.device();
      rb[r].s = c.stream();
      MOK_CUDA_CHECK(cudaSetDevice(rb[r].dev));
      MOK_CUDA_CHECK(cudaMalloc(&rb[r].y, max_bytes));
      MOK_CUDA_CHECK(cudaMalloc(&rb[r].perm, sizeof(int) * rows_for(2048)));
      rb[r].x_local = static_cast<char*>(c.window("x").ptr);
      rb[r].x_peer = static_cast<char*>(mc::dev::lsa_pointer(c, c.window("x"), 1 - r));
      set_kernel_attributes(rb[r].dev);
    }
    // Peer access for cudaMemcpyPeer's direct NVLink path (NCCL may have enabled it already).
    for (int r = 0; r < 2; ++r) {
      MOK_REQUIRE(mb::enable_peer_access(r, 1 - r), "GPUs", "comm_bench needs peer access between GPU 0 and GPU 1");
    }


    // NVLink hardware counters (nvidia-smi nvlink -gt d|r) around known workloads: bytes each way.
    struct LinkRow {
      std::string name;
      double payload;
      double data[4], raw[4];  // GPU0 tx, GPU0 rx, GPU1 tx, GPU1 rx (bytes)
    };
    std::vector<LinkRow> links;
    std::mt19937 link_rng(4242u);
    auto run_link_probes = [&](bool full) {
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
    };

    struct SmProbe {
      std::string name;
      double gbps[3];  // 1, 2, 4 SMs
    };
    std::vector<SmProbe> sm_probes;
    auto run_sm_probes = [&]() {
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

    };
    if (args.probe) {
      run_sm_probes();
      run_link_probes(true);
      return 0;
    }

    // ---------------------------------------------------------------- copy ceiling
    double ceil_10 = 0, ceil_01 = 0, bidir_each = 0;
    {
      void* b0 = nullptr;
      void* b1 = nullptr;
      MOK_CUDA_CHECK(cudaSetDevice(0));
      MOK_CUDA_CHECK(cudaMalloc(&b0, kCeilingBytes));
      MOK_CUDA_CHECK(cudaMemset(b0, 1, kCeilingBytes));
      MOK_CUDA_CHECK(cudaSetDevice(1));
      MOK_CUDA_CHECK(cudaMalloc(&b1, kCeilingBytes));
      MOK_CUDA_CHECK(cudaMemset(b1, 2, kCeilingBytes));
      void* c0 = nullptr;
      void* c1 = nullptr;
      MOK_CUDA_CHECK(cudaSetDevice(0));
      MOK_CUDA_CHECK(cudaMalloc(&c0, kCeilingBytes));
      MOK_CUDA_CHECK(cudaSetDevice(1));
      MOK_CUDA_CHECK(cudaMalloc(&c1, kCeilingBytes));
      auto one_way = [&](int dst_dev, void* dst, int src_dev, const void* src) {
        return mb::peer_copy_GBps(dst, dst_dev, src, src_dev, kCeilingBytes, rb[dst_dev].s);
      };
      ceil_10 = one_way(0, c0, 1, b1);  // GPU1 -> GPU0: the direction rank 0's pull moves data
      ceil_01 = one_way(1, c1, 0, b0);  // GPU0 -> GPU1: the direction rank 0's push moves data
      {
        Timer t0(0), t1(1);
        std::vector<double> ms0, ms1;
        for (int i = 0; i < 2 + 5; ++i) {
          MOK_CUDA_CHECK(cudaSetDevice(0));
          MOK_CUDA_CHECK(cudaEventRecord(t0.a, rb[0].s));
          MOK_CUDA_CHECK(cudaMemcpyPeerAsync(c0, 0, b1, 1, kCeilingBytes, rb[0].s));
          MOK_CUDA_CHECK(cudaEventRecord(t0.b, rb[0].s));
          MOK_CUDA_CHECK(cudaSetDevice(1));
          MOK_CUDA_CHECK(cudaEventRecord(t1.a, rb[1].s));
          MOK_CUDA_CHECK(cudaMemcpyPeerAsync(c1, 1, b0, 0, kCeilingBytes, rb[1].s));
          MOK_CUDA_CHECK(cudaEventRecord(t1.b, rb[1].s));
          MOK_CUDA_CHECK(cudaEventSynchronize(t1.b));
          MOK_CUDA_CHECK(cudaEventSynchronize(t0.b));
          if (i >= 2) {
            ms0.push_back(t0.ms());
            ms1.push_back(t1.ms());
          }
        }
        bidir_each = std::min(static_cast<double>(kCeilingBytes) / (median(ms0) * 1e-3) / 1e9,
                              static_cast<double>(kCeilingBytes) / (median(ms1) * 1e-3) / 1e9);
      }
      for (int d = 0; d < 2; ++d) {
        MOK_CUDA_CHECK(cudaSetDevice(d));
        MOK_CUDA_CHECK(cudaDeviceSynchronize());
      }
      MOK_CUDA_CHECK(cudaFree(b0));
      MOK_CUDA_CHECK(cudaFree(b1));
      MOK_CUDA_CHECK(cudaFree(c0));
      MOK_CUDA_CHECK(cudaFree(c1));
    }
    const double ceiling = std::max(ceil_10, ceil_01);
    std::printf("[comm_bench] cudaMemcpyPeer 1 GiB: GPU1->GPU0 %.1f GB/s, GPU0->GPU1 %.1f GB/s, both at once %.1f GB/s "
                "each; ceiling = %.1f GB/s (the larger one-way)\n",
                ceil_10, ceil_01, bidir_each, ceiling);

    // ---------------------------------------------------------------- pull / push bandwidth
    std::vector<Result> results, bidir;
    const std::vector<std::string> methods = {"tma", "ldst"};
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
      for (const auto& method : methods) {
        for (int nsm : kSmCounts) measure("pull", method, nsm);
      }
      // Both GPUs pull from each other at once (the dispatch pattern with 2 ranks).
      if (hidden == 7168) {
        for (const auto& method : methods) {
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
      for (const auto& method : methods) {
        for (int nsm : kSmCounts) measure("push", method, nsm);
      }
    }

    // ---------------------------------------------------------------- signalling latency
    struct Lat {
      std::string mode;
      int ctas;
      double us;
      unsigned long long bad, stored, loaded, flags;
      uint32_t hops_total;
    };
    std::vector<Lat> lats;
    const uint32_t warm = 200, hops = args.quick ? 400 : 2000;
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

    // ---------------------------------------------------------------- probes (per-SM rate, NVLink bytes)
    run_sm_probes();
    run_link_probes(false);

    // ---------------------------------------------------------------- JSON
    auto find_lat = [&](const std::string& mode, int k) {
      for (const auto& l : lats) {
        if (l.mode == mode && l.ctas == k) return l;
      }
      return Lat{};
    };
    std::ostringstream js;
    js.precision(6);
    js << "{\n";
    js << "  \"device\": \"" << prop.name << "\",\n";
    js << "  \"gpus\": " << 2 << ",\n";
    js << "  \"date\": \"" << now_utc() << "\",\n";
    js << "  \"commit\": \"" << args.commit << "\",\n";
    js << "  \"nccl_version\": " << NCCL_VERSION_CODE << ",\n";
    js << "  \"copy_ceiling_GBps\": " << ceiling << ",\n";
    js << "  \"copy_ceiling_detail\": {\"method\": \"cudaMemcpyPeerAsync, 1 GiB, median of 5\", "
          "\"gpu1_to_gpu0_GBps\": " << ceil_10 << ", \"gpu0_to_gpu1_GBps\": " << ceil_01
       << ", \"both_directions_at_once_each_GBps\": " << bidir_each
       << ", \"ceiling_is\": \"the larger one-way figure\"},\n";
    js << "  \"results\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      js << "    {\"mode\": \"" << r.mode << "\", \"method\": \"" << r.method << "\", \"hidden\": " << r.hidden
         << ", \"comm_sms\": " << r.sms << ", \"GBps\": " << r.gbps << ", \"ms\": " << r.ms
         << ", \"rows\": " << rows_for(r.hidden) << ", \"fraction_of_ceiling\": " << r.gbps / ceiling
         << ", \"wrong_words\": " << r.bad << "}" << (i + 1 < results.size() ? "," : "") << "\n";
    }
    js << "  ],\n";
    js << "  \"results_bidirectional\": [\n";
    for (size_t i = 0; i < bidir.size(); ++i) {
      const auto& r = bidir[i];
      js << "    {\"mode\": \"" << r.mode << "\", \"method\": \"" << r.method << "\", \"hidden\": " << r.hidden
         << ", \"comm_sms\": " << r.sms << ", \"GBps_per_gpu\": " << r.gbps
         << ", \"fraction_of_two_way_memcpy\": " << r.gbps / bidir_each << ", \"wrong_words\": " << r.bad << "}"
         << (i + 1 < bidir.size() ? "," : "") << "\n";
    }
    js << "  ],\n";
    js << "  \"signal_latency_us\": {\"push\": " << find_lat("push", 1).us << ", \"pull\": " << find_lat("pull", 1).us
       << "},\n";
    js << "  \"signal_latency_detail\": [\n";
    for (size_t i = 0; i < lats.size(); ++i) {
      const auto& l = lats[i];
      const double per = static_cast<double>(l.hops_total);
      js << "    {\"mode\": \"" << l.mode << "\", \"ctas\": " << l.ctas << ", \"us_per_handoff\": " << l.us
         << ", \"timed_handoffs\": " << hops << ", \"wrong_words\": " << l.bad
         << ", \"bytes_per_handoff\": {\"payload_stored_to_peer\": " << static_cast<double>(l.stored) / per
         << ", \"payload_loaded_from_peer\": " << static_cast<double>(l.loaded) / per
         << ", \"flag_bytes_to_peer\": " << 4.0 * static_cast<double>(l.flags) / per << "}}"
         << (i + 1 < lats.size() ? "," : "") << "\n";
    }
    js << "  ],\n";
    js << "  \"per_sm_probe\": {\"what\": \"GB/s of one copy variant with 1, 2, 4 SMs (H=7168, 16384 rows, GPU0): "
          "bytes in flight vs the per-SM limit; local gather = the same kernel on GPU0's own memory\", \"rows\": [\n";
    for (size_t i = 0; i < sm_probes.size(); ++i) {
      js << "    {\"variant\": \"" << sm_probes[i].name << "\", \"GBps_1sm\": " << sm_probes[i].gbps[0]
         << ", \"GBps_2sm\": " << sm_probes[i].gbps[1] << ", \"GBps_4sm\": " << sm_probes[i].gbps[2] << "}"
         << (i + 1 < sm_probes.size() ? "," : "") << "\n";
    }
    js << "  ]},\n";
    js << "  \"nvlink_bytes\": {\"what\": \"NVLink counters (nvidia-smi nvlink -gt d = data payload, -gt r = payload + "
          "protocol) summed over links, read before/after each workload; bytes\", \"rows\": [\n";
    for (size_t i = 0; i < links.size(); ++i) {
      const auto& l = links[i];
      js << "    {\"workload\": \"" << l.name << "\", \"payload_bytes\": " << l.payload
         << ", \"data\": {\"gpu0_tx\": " << l.data[0] << ", \"gpu0_rx\": " << l.data[1] << ", \"gpu1_tx\": " << l.data[2]
         << ", \"gpu1_rx\": " << l.data[3] << "}, \"raw\": {\"gpu0_tx\": " << l.raw[0] << ", \"gpu0_rx\": " << l.raw[1]
         << ", \"gpu1_tx\": " << l.raw[2] << ", \"gpu1_rx\": " << l.raw[3] << "}";
      if (l.payload > 0) {
        js << ", \"raw_gpu0_tx_per_payload_byte\": " << l.raw[0] / l.payload
           << ", \"raw_gpu1_tx_per_payload_byte\": " << l.raw[2] / l.payload;
      }
      js << "}" << (i + 1 < links.size() ? "," : "") << "\n";
    }
    js << "  ]},\n";
    js << "  \"notes\": \"GBps = payload bytes / median kernel time (1e9 B/GB); pull = GPU0 gathers rows from GPU1's "
          "NCCL window through ncclGetLsaPointer addresses, push = GPU0 scatters rows into it; rows in random order; "
          "every configuration's output is poisoned, copied once and checked. Signal latency: one 128 KiB block "
          "handed back and forth, us per hand-off on rank 0, 1 CTA of 512 threads unless ctas says otherwise; bytes "
          "from the kernels' own counters (payload and flag stores/loads that cross NVLink, not link-level "
          "packets).\"\n";
    js << "}\n";
    if (!args.out.empty()) {
      FILE* f = std::fopen(args.out.c_str(), "w");
      if (!f) throw mok::Error(mok::ErrorKind::Runtime, "--out", "cannot open " + args.out);
      std::fputs(js.str().c_str(), f);
      std::fclose(f);
      std::printf("[comm_bench] wrote %s\n", args.out.c_str());
    }

    // ---------------------------------------------------------------- short table (last)
    std::printf("\n=== comm bench: %s x2, ceiling %.1f GB/s (memcpyPeer 1 GiB) ===\n", prop.name, ceiling);
    std::printf("%-5s %-5s %6s |", "mode", "meth", "H");
    for (int nsm : kSmCounts) std::printf(" %6d SM", nsm);
    std::printf("\n");
    for (int hidden : kHiddens) {
      for (const char* mode : {"pull", "push"}) {
        for (const auto& method : methods) {
          std::printf("%-5s %-5s %6d |", mode, method.c_str(), hidden);
          for (int nsm : kSmCounts) {
            for (const auto& r : results) {
              if (r.mode == mode && r.method == method && r.hidden == hidden && r.sms == nsm)
                std::printf(" %9.1f", r.gbps);
            }
          }
          std::printf("\n");
        }
      }
    }
    std::printf("hand-off 256x256 bf16 (1 CTA): push %.2f us, pull %.2f us; 16 CTAs: push %.2f us, pull %.2f us\n",
                find_lat("push", 1).us, find_lat("pull", 1).us, find_lat("push", 16).us, find_lat("pull", 16).us);
    for (const auto& p : sm_probes) {
      if (p.name.rfind("pull ldst unroll 8", 0) == 0 || p.name.rfind("local gather ldst", 0) == 0)
        std::printf("per-SM: %-30s 1/2/4 SMs %.1f / %.1f / %.1f GB/s\n", p.name.c_str(), p.gbps[0], p.gbps[1], p.gbps[2]);
    }
    for (const auto& l : links) {
      if (l.payload > 0)
        std::printf("NVLink raw bytes per payload byte, %-28s GPU0 tx %.3f, GPU1 tx %.3f\n", l.name.c_str(),
                    l.raw[0] / l.payload, l.raw[2] / l.payload);
    }
    unsigned long long wrong = 0;
    for (const auto& r : results) wrong += r.bad;
    for (const auto& r : bidir) wrong += r.bad;
    for (const auto& l : lats) wrong += l.bad;
    std::printf("wrong words in all checks: %llu\n", wrong);
    for (auto& b : rb) {
      (void)cudaSetDevice(b.dev);
      (void)cudaFree(b.y);
      (void)cudaFree(b.perm);
    }
    return wrong == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[comm_bench] error: %s\n", e.what());
    return 1;
  }
}
