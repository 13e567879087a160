// mok_comm_bench — pull vs push of token rows over NVLink through NCCL 2.28 symmetric windows,
// against the copy ceiling (cudaMemcpyPeer of 1 GiB, same run), and the signalling latency of a
// 256x256 bf16 hand-off. One process drives GPUs 0 and 1 (mok::comm::LocalGroup).
//
// usage: mok_comm_bench [--out FILE.json] [--commit SHA] [--reps N] [--quick]
//
// GB/s = payload bytes moved from one GPU to the other / median kernel time (1 GB = 1e9 B).
// pull: rank 0's CTAs gather rows x1[perm[i]] from GPU 1's window into y0[i] (GPU 1 idle).
// push: rank 0's CTAs scatter y0[i] into GPU 1's window at x1[perm[i]].
//
// This file drives the run (options, buffers, the copy ceiling, the JSON file, the table);
// comm_measure.cu launches the kernels (comm_bench.h says why they are apart).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "comm/device.cuh"
#include "comm_bench.h"
#include "common/cuda_check.h"
#include "mok/comm.hpp"
#include "util/peer_copy.h"

namespace mc = mok::comm;
namespace mb = mok::bench;

namespace mok::bench::comm_bench {
namespace {

constexpr size_t kCeilingBytes = mb::kPeerCopyBytes;

std::string now_utc() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

int run(int argc, char** argv) {
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
    opts.windows = {{"x", max_bytes}, {"sig", sig_window_bytes()}};
    auto group = mc::LocalGroup::create({0, 1}, opts);
    mc::register_wait_name(mc::kWaitUserBase + 100, "bench.signal_pingpong");

    // Per-rank buffers: local rows y, permutation, streams.
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

    if (args.probe) {
      run_sm_probes(rb);
      run_link_probes(group, rb, true);
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
    measure_bandwidth(rb, args, ceiling, bidir_each, results, bidir);

    // ---------------------------------------------------------------- signalling latency
    const std::vector<Lat> lats = measure_latency(group, args);
    const uint32_t hops = timed_handoffs(args);

    // ---------------------------------------------------------------- probes (per-SM rate, NVLink bytes)
    const std::vector<SmProbe> sm_probes = run_sm_probes(rb);
    const std::vector<LinkRow> links = run_link_probes(group, rb, false);

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
        for (const auto& method : kMethods) {
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

}  // namespace
}  // namespace mok::bench::comm_bench

int main(int argc, char** argv) { return mok::bench::comm_bench::run(argc, argv); }
