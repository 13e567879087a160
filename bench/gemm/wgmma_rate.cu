// mok_wgmma_rate — the tensor rate one SM reaches from shared-memory operands when 1, 2 or 3
// warpgroups issue BF16 wgmma back to back: no loads, no epilogue, MACs per SM cycle.
//
// The question (notes/gemm.md "Short weight-gradient tiles", notes/backward.md): can one warpgroup
// alone drive the tensor cores at about the full rate? If it can, one warpgroup's epilogue can run
// while the other's MMAs keep the SM busy (ping-pong, or per-warpgroup epilogues that drift apart);
// if a warpgroup alone reaches about half, no such overlap can pay. The notes assumed "half" from
// split-N and skipped tiles, which are bound by their loads, so it was never measured alone.
//
// Variants: m64nNk16 with N = 256 or 128; 1, 2 or 3 warpgroups; every warpgroup reading the same B
// tile (as the cooperative 128 x 256 tile does) or each its own (as ping-pong tiles do); operands
// K-major (the forward's) or both MN-major (the weight gradient's: transposed in the tensor cores). Operands
// stay in shared memory (per warpgroup an A tile [64 x 64], B [N x 64], K-major, 128-byte
// swizzle, zeros: the values do not change the rate per cycle, only the power). Each warpgroup
// runs `iters` K blocks of four wgmmas, one commit group each with one group in flight (the
// engine's mainloop). The SM's cycles come from clock64 around the loop of every warpgroup; the
// rate is warpgroups x iters x 4 x (64 x N x 16) MACs over the slowest warpgroup's cycles, the
// median over the SMs. Hopper's dense BF16 peak is 2048 MACs per SM cycle (989 TF/s at 1.83 GHz on
// 132 SMs), which `pct_of_peak` uses.
//
//   mok_wgmma_rate [--iters N] [--out rate.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "gemm/sm90.cuh"
#include "util/parse_number.h"

namespace {

namespace sm90 = mok::gemm::sm90;
constexpr double kPeakMacsPerClk = 2048.0;
constexpr int kMaxWarpgroups = 3;

template <int N, int kWarpgroups, bool kOwnB>
constexpr int smem_bytes() {
  return kWarpgroups * 8192 + (kOwnB ? kWarpgroups : 1) * N * 128;
}

template <int N, int kWarpgroups, bool kOwnB, bool kMN>
__global__ void __launch_bounds__(128 * kWarpgroups, 1)
    rate_kernel(int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kBytes = smem_bytes<N, kWarpgroups, kOwnB>();
  for (int i = int(threadIdx.x); i < kBytes / 16; i += int(blockDim.x))
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  // The zeros (generic proxy) before the wgmmas read them (async proxy).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = int(threadIdx.x / 128u);
  const uint32_t a = sm90::smem_addr(smem) + uint32_t(wg) * 8192u;
  const uint32_t b = sm90::smem_addr(smem) + uint32_t(kWarpgroups) * 8192u + (kOwnB ? uint32_t(wg) * N * 128u : 0u);
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kMN)  // both operands MN-major (transposed), as the weight gradient reads them
        sm90::wgmma_bf16<N, 1, 1>(acc, sm90::desc_mn_major(a, k, 8192u), sm90::desc_mn_major(b, k, 8192u), 1u);
      else
        sm90::wgmma_bf16<N, 0, 0>(acc, sm90::desc_k_major(a, k), sm90::desc_k_major(b, k), 1u);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::fence_operands(acc);
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc);
  const long long t1 = clock64();
  if (threadIdx.x % 128u == 0) cycles[blockIdx.x * kMaxWarpgroups + wg] = t1 - t0;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  if (s != 0.0f) sink[blockIdx.x] = s;  // (zeros: never stored; the sums stay live)
}

struct Result {
  int n, warpgroups;
  bool own_b, mn;
  double macs_per_clk;  // median over SMs
  double min_macs_per_clk, max_macs_per_clk;
};

template <int N, int kWarpgroups, bool kOwnB, bool kMN = false>
Result run(int sms, int iters, long long* d_cycles, float* d_sink) {
  constexpr int kBytes = smem_bytes<N, kWarpgroups, kOwnB>();
  auto* k = rate_kernel<N, kWarpgroups, kOwnB, kMN>;
  MOK_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  // A warm-up launch (clocks up, the module loaded), then the measured one.
  for (int rep = 0; rep < 2; ++rep) {
    MOK_CUDA_CHECK(cudaMemset(d_cycles, 0, sizeof(long long) * size_t(sms) * kMaxWarpgroups));
    k<<<sms, 128 * kWarpgroups, kBytes>>>(iters, d_cycles, d_sink);
    MOK_CUDA_CHECK(cudaGetLastError());
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<long long> cyc(size_t(sms) * kMaxWarpgroups);
  MOK_CUDA_CHECK(cudaMemcpy(cyc.data(), d_cycles, cyc.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::vector<double> rate;
  const double macs = double(kWarpgroups) * iters * 4.0 * 64.0 * N * 16.0;
  for (int s = 0; s < sms; ++s) {
    long long slowest = 0;
    for (int w = 0; w < kWarpgroups; ++w) slowest = std::max(slowest, cyc[size_t(s) * kMaxWarpgroups + w]);
    if (slowest > 0) rate.push_back(macs / double(slowest));
  }
  std::sort(rate.begin(), rate.end());
  Result r{N, kWarpgroups, kOwnB, kMN, 0.0, 0.0, 0.0};
  if (!rate.empty()) {
    r.macs_per_clk = rate[rate.size() / 2];
    r.min_macs_per_clk = rate.front();
    r.max_macs_per_clk = rate.back();
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  std::string out;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--iters" && i + 1 < argc) {
        iters = mok::bench::parse_number("--iters", argv[++i], 100, 100000000);
      } else if (a == "--out" && i + 1 < argc) {
        out = argv[++i];
      } else {
        std::fprintf(stderr, "usage: %s [--iters N >= 100 (default 20000)] [--out rate.json]\n", argv[0]);
        return a == "--help" || a == "-h" ? 0 : 2;
      }
    }
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  int dev = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&d_cycles, sizeof(long long) * size_t(sms) * kMaxWarpgroups));
  MOK_CUDA_CHECK(cudaMalloc(&d_sink, sizeof(float) * size_t(sms)));
  std::vector<Result> res = {
      run<256, 1, false>(sms, iters, d_cycles, d_sink), run<256, 2, false>(sms, iters, d_cycles, d_sink),
      run<256, 2, true>(sms, iters, d_cycles, d_sink),  run<256, 3, false>(sms, iters, d_cycles, d_sink),
      run<128, 1, false>(sms, iters, d_cycles, d_sink), run<128, 2, false>(sms, iters, d_cycles, d_sink),
      run<128, 2, true>(sms, iters, d_cycles, d_sink),  run<128, 3, true>(sms, iters, d_cycles, d_sink),
      run<256, 1, false, true>(sms, iters, d_cycles, d_sink), run<256, 2, false, true>(sms, iters, d_cycles, d_sink),
      run<128, 2, false, true>(sms, iters, d_cycles, d_sink)};
  cudaFree(d_cycles);
  cudaFree(d_sink);
  std::printf("mok_wgmma_rate on %s (%d SMs), %d K blocks of 4 wgmmas per warpgroup\n", prop.name, sms, iters);
  std::printf("| wgmma | operands | warpgroups | B | MACs / SM cycle (median; min-max over SMs) | %% of 2048 |\n"
              "|---|---|---|---|---|---|\n");
  for (const Result& r : res)
    std::printf("| m64n%dk16 | %s | %d | %s | %.0f (%.0f-%.0f) | %.1f%% |\n", r.n, r.mn ? "MN-major" : "K-major",
                r.warpgroups, r.own_b ? "own" : "shared", r.macs_per_clk, r.min_macs_per_clk, r.max_macs_per_clk,
                100.0 * r.macs_per_clk / kPeakMacsPerClk);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "mok_wgmma_rate: cannot write %s\n", out.c_str());
      return 1;
    }
    std::fprintf(f, "{\n \"device\": \"%s\",\n \"sms\": %d,\n \"iters\": %d,\n \"peak_macs_per_clk\": %.0f,\n \"cases\": [\n",
                 prop.name, sms, iters, kPeakMacsPerClk);
    for (size_t i = 0; i < res.size(); ++i) {
      const Result& r = res[i];
      std::fprintf(f,
                   "  {\"wgmma\": \"m64n%dk16\", \"operands\": \"%s\", \"warpgroups\": %d, \"b\": \"%s\", "
                   "\"macs_per_clk\": %.1f, \"min_macs_per_clk\": %.1f, \"max_macs_per_clk\": %.1f, "
                   "\"pct_of_peak\": %.2f}%s\n",
                   r.n, r.mn ? "MN-major" : "K-major", r.warpgroups, r.own_b ? "own" : "shared", r.macs_per_clk, r.min_macs_per_clk,
                   r.max_macs_per_clk, 100.0 * r.macs_per_clk / kPeakMacsPerClk, i + 1 < res.size() ? "," : "");
    }
    std::fprintf(f, " ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
