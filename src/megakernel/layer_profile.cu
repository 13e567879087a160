// The layer's MOK_PROFILE=1 lines (Layer::profile_summary): the forward megakernel's per-CTA
// counters summed over its CTAs, and the last backward's stage times from its events (over
// windows also each window stage, summed over the windows).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "megakernel/forward_kernel.h"
#include "megakernel/layer_impl.h"

namespace mok {

std::string Layer::profile_summary() const {
  const std::string fwd = impl_->forward_profile(), bwd = impl_->backward_profile();
  return fwd.empty() || bwd.empty() ? fwd + bwd : fwd + "\n" + bwd;
}

std::string Layer::Impl::forward_profile() const {
  const Impl& m = *this;
  if (m.stats.p == nullptr) return "";
  std::vector<unsigned long long> w(static_cast<size_t>(m.sms) * mk::kForwardStatWords);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  MOK_CUDA_CHECK(cudaMemcpy(w.data(), m.stats.p, w.size() * 8, cudaMemcpyDeviceToHost));
  const int c = m.mkp.plan.comm_ctas;
  double span = 0, busy = 0, wait = 0, dep = 0, tiles = 0, cspan = 0, pull = 0, push = 0, idle = 0, max_span = 0;
  double start = 0, epi = 0, fc2 = 0, fc2_tiles = 0, mc_tiles = 0, cycles = 0;
  for (int b = 0; b < m.grid; ++b) {
    const unsigned long long* s = &w[static_cast<size_t>(b) * mk::kForwardStatWords];
    max_span = std::max(max_span, double(s[mk::kStatSpan]));
    if (b < c) {
      cspan += double(s[mk::kStatCommSpan]);
      pull += double(s[mk::kStatPull]);
      push += double(s[mk::kStatPush]);
      idle += double(s[mk::kStatIdle]);
    } else {
      span += double(s[mk::kStatSpan]);
      busy += double(s[mk::kStatBusy]);
      wait += double(s[mk::kStatWaitTask]);
      dep += double(s[mk::kStatDeps]);
      tiles += double(s[mk::kStatTiles]);
      start += double(s[mk::kStatFirstStage]);
      epi += double(s[mk::kStatEpilogue]);
      fc2 += double(s[mk::kStatFc2]);
      fc2_tiles += double(s[mk::kStatFc2Tiles]);
      mc_tiles += double(s[mk::kStatMulticast]);
      cycles += double(s[mk::kStatCycles]);
    }
  }
  const auto pct = [](double a, double b) { return b > 0 ? 100.0 * a / b : 0.0; };
  const auto per_tile_us = [](double ns, double n) { return n > 0 ? ns / n * 1e-3 : 0.0; };
  // With clusters only rank 0's producer claims tasks and waits for dependencies.
  const double dep_span = m.mkp.cluster ? span / 2 : span;
  char pairs[96] = "";
  if (m.mkp.cluster)
    std::snprintf(pairs, sizeof pairs, ", B multicast for %.1f%% of the tiles", pct(mc_tiles, tiles));
  char line[896];
  std::snprintf(line, sizeof line,
                "kernel %.3f ms, SM clock %.2f GHz (compute CTAs' average); %d compute CTAs: busy %.1f%% (of it: first stage of a tile %.1f%%, epilogues "
                "%.1f%%), waiting for a task %.1f%%, producer on dependencies %.1f%%, %.1f tiles/CTA, %.1f us/tile "
                "(FC2 %.1f, others %.1f)%s; %d comm CTAs: pull %.1f%%, push %.1f%%, idle %.1f%%",
                max_span * 1e-6, span > 0 ? cycles / span : 0.0, m.grid - c, pct(busy, span), pct(start, span), pct(epi, span), pct(wait, span),
                pct(dep, dep_span), tiles / std::max(1, m.grid - c), per_tile_us(busy, tiles),
                per_tile_us(fc2, fc2_tiles), per_tile_us(busy - fc2, tiles - fc2_tiles), pairs, c, pct(pull, cspan),
                pct(push, cspan), pct(idle, cspan));
  return line;
}

// The last backward's stage times (MOK_PROFILE=1), or "".
std::string Layer::Impl::backward_profile() const {
  if (!bwd_marked) return "";
  MOK_CUDA_CHECK(cudaEventSynchronize(bwd_marks.back()));
  std::string line = "backward stages (ms):";
  float total = 0;
  for (int i = 0; i < kBwdStages; ++i) {
    // Over windows, stages 2-7 are one (its parts are summed below): the others' marks follow it.
    if (windowed && i >= 3 && i <= 7) continue;
    float ms = 0;
    const int end = windowed && i == 2 ? 8 : i + 1;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, bwd_marks[static_cast<size_t>(i)], bwd_marks[static_cast<size_t>(end)]));
    total += ms;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s %s %.3f", i ? "," : "", windowed && i == 2 ? "windows" : kBwdStageNames[i], ms);
    line += buf;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "; total %.3f", total);
  line += buf;
  if (windowed && windows_marked > 0) {
    std::snprintf(buf, sizeof buf, "; over %lld windows:", static_cast<long long>(windows_marked));
    line += buf;
    for (int i = 0; i < kWinStages; ++i) {
      float sum = 0;
      for (int64_t w = 0; w < windows_marked; ++w) {
        const size_t at = static_cast<size_t>(w * (kWinStages + 1) + i);
        float ms = 0;
        MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, win_marks[at], win_marks[at + 1]));
        sum += ms;
      }
      std::snprintf(buf, sizeof buf, "%s %s %.3f", i ? "," : "", kWinStageNames[i], sum);
      line += buf;
    }
  }
  return line;
}

}  // namespace mok
