// mok_fp8_backward_bench — the expert FFN backward's GEMM chain on one GPU, BF16 against FP8
// (issue 22, recipe 1), on the layer's routed layout: what a backward spends in its GEMMs and,
// for FP8, in the quantization passes it adds (unfused here: each is a kernel of
// src/gemm/fp8_quantize.h). No communication: the per-rank work of one backward.
//   BF16: dgrad + SwiGLU' (unweighted d_out rows, their router weights: d_gu, the router-weight
//         partials, hw) -> FC1's dgrad -> dW_down = d^T hw -> dW_gate, dW_up = d_gu^T x.
//   FP8:  d per 1 x 128 -> the FP8 dgrad + SwiGLU' -> d_gu per 1 x 128 -> FC1's FP8 dgrad; d, hw,
//         d_gu and x per 128 x 1 token block (transposed) -> the FP8 wgrads. The weights' K-major
//         codes (transposed, 128 x 128; made once per weight update, i.e. once per training
//         step) are timed apart ("weights": gemm::quantize_fp8_weights_t, one pass per weight;
//         "weights_two_step": the transpose + quantizer path it replaced, for comparison).
// Each chain is timed as a whole (CUDA events around it, warm-up, median of --reps), and each
// step inside it (events between the steps, run_chain); the FP8 chain's outputs are compared with the BF16 chain's (the recipe's error,
// a few 1e-2, not a check of bits: the GPU tests check the forms against the spec).
//   mok_fp8_backward_bench [--out FILE] [--reps N] [--filter SUBSTR] [--commit SHA]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_gemm_util.cuh"
#include "common/cuda_check.h"
#include "gemm/fp8_quantize.h"
#include "mok/gemm.hpp"
#include "util/bench_util.h"
#include "util/parse_number.h"

namespace {

namespace gemm = mok::gemm;
namespace fp8 = mok::fp8;
using namespace mok::bench_gemm;

struct Model {
  const char* name;
  int64_t hidden, inter, experts;  // experts: one EP-8 rank's
};
const Model kModels[] = {{"dsv3", 7168, 2048, 32}, {"qwen3-30b-a3b", 2048, 768, 16}, {"qwen3-235b-a22b", 4096, 1536, 16}};

using Step = std::pair<std::string, std::function<void()>>;

// ||a - b|| / ||b|| of two bf16 device arrays.
double rel_diff(const void* a, const void* b, int64_t n) {
  std::vector<uint16_t> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  MOK_CUDA_CHECK(cudaMemcpy(ha.data(), a, size_t(n) * 2, cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaMemcpy(hb.data(), b, size_t(n) * 2, cudaMemcpyDeviceToHost));
  double d2 = 0, r2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = host_bf16(ha[size_t(i)]), y = host_bf16(hb[size_t(i)]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    d2 += (x - y) * (x - y);
    r2 += y * y;
  }
  return std::sqrt(d2 / std::max(r2, 1e-300));
}

struct Result {
  std::vector<std::pair<std::string, double>> steps;  // ms each
  double chain_ms = 0;
};

// The chain: 3 warm-up runs, then `reps` runs with an event before the first step and after each;
// the chain's median, and each step's median between its two events *inside* the chain. (Timed
// alone, a step repeated back to back runs at another clock than in the chain: these GPUs sit at
// their power cap, and a step's own draw sets its clock. The FP8 dgrad + SwiGLU' measured 3.11 ms
// alone after the bf16 chain and 2.25 ms alone after an Nsight Compute pause, 2.20 under ncu; the
// chain's total did not move.)
Result run_chain(const std::vector<Step>& steps, int reps) {
  const size_t n = steps.size();
  std::vector<cudaEvent_t> ev(n + 1);
  for (auto& e : ev) MOK_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i)
    for (const auto& s : steps) s.second();
  std::vector<std::vector<float>> per(n);
  std::vector<float> total;
  for (int i = 0; i < reps; ++i) {
    MOK_CUDA_CHECK(cudaEventRecord(ev[0]));
    for (size_t j = 0; j < n; ++j) {
      steps[j].second();
      MOK_CUDA_CHECK(cudaEventRecord(ev[j + 1]));
    }
    MOK_CUDA_CHECK(cudaEventSynchronize(ev[n]));
    float t = 0;
    for (size_t j = 0; j < n; ++j) {
      MOK_CUDA_CHECK(cudaEventElapsedTime(&t, ev[j], ev[j + 1]));
      per[j].push_back(t);
    }
    MOK_CUDA_CHECK(cudaEventElapsedTime(&t, ev[0], ev[n]));
    total.push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  const auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return double(v[v.size() / 2]);
  };
  Result r;
  for (size_t j = 0; j < n; ++j) r.steps.emplace_back(steps[j].first, median(per[j]));
  r.chain_ms = median(total);
  return r;
}

void add_buf(std::vector<std::unique_ptr<Buf>>& keep, void*& p, size_t bytes) {
  keep.emplace_back(new Buf(bytes));
  p = keep.back()->p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "fp8_backward.json", filter, commit = mok::bench::commit();  // (MOK_COMMIT)
  int reps = 20;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--out" && i + 1 < argc) out_path = argv[++i];
      else if (a == "--reps" && i + 1 < argc) reps = mok::bench::parse_number("--reps", argv[++i], 1, 100000);
      else if (a == "--filter" && i + 1 < argc) filter = argv[++i];
      else if (a == "--commit" && i + 1 < argc) commit = argv[++i];
      else {
        std::fprintf(stderr, "usage: %s [--out FILE] [--reps N] [--filter SUBSTR] [--commit SHA]\n", argv[0]);
        return 2;
      }
    }
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  const std::string date = mok::bench::utc_date();
  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  FILE* f = std::fopen(out_path.c_str(), "w");
  if (!f) {
    std::perror(out_path.c_str());
    return 1;
  }
  std::fprintf(f, "{\"device\": \"%s\", \"gpus\": 1, \"date\": \"%s\", \"commit\": \"%s\", \"what\": \"expert FFN "
               "backward GEMM chain per EP-8 rank slice, bf16 vs fp8 (recipe 1), no communication\", \"method\": "
               "\"mok_fp8_backward_bench: per case the chain timed as a whole and each step inside it (CUDA events between the steps, 3 "
               "warm-up runs, median of %d); uniform routing, EP-8 rank slices (E/8 experts); flops = the 4 backward "
               "GEMMs'; the fp8 steps as the layer's FP8 backward runs them (quantize_dy, quantize_dgu: 1 x 128 rows and "
               "128 x 1 token blocks in one pass; token_blocks: w h and x, x read through the layer's row gather); "
               "fp8_two_pass_ms: the same fp8 chain with a pass per form and operand (the A/B); fp8_weights_ms: the weights' K-major codes in one pass (quantize_fp8_weights_t), "
               "fp8_weights_two_step_ms: the transpose + quantizer path; fp8_vs_bf16_rel = ||fp8 - bf16|| / ||bf16|| of "
               "the chains' outputs\", \"cases\": [\n",
               prop.name, date.c_str(), commit.c_str(), reps);
  bool first = true;
  for (const Model& m : kModels)
    for (const int64_t per : {int64_t(512), int64_t(2048)}) {
      const std::string name = std::string(m.name) + "/" + std::to_string(per);
      if (!filter.empty() && name.find(filter) == std::string::npos) continue;
      const int64_t E = m.experts, H = m.hidden, I = m.inter, rows = E * per, n2 = 2 * I;
      std::vector<int32_t> counts(static_cast<size_t>(E), static_cast<int32_t>(per)), begin, tile_expert;
      for (int64_t e = 0; e < E; ++e) {
        begin.push_back(int32_t(e * per));
        for (int64_t t = 0; t < per / 128; ++t) tile_expert.push_back(int32_t(e));
      }
      std::vector<std::unique_ptr<Buf>> keep;
      const auto dev_i32 = [&](const std::vector<int32_t>& v) {
        void* p = nullptr;
        add_buf(keep, p, v.size() * 4);
        MOK_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
        return static_cast<const int32_t*>(p);
      };
      const int32_t *d_te = dev_i32(tile_expert), *d_beg = dev_i32(begin), *d_cnt = dev_i32(counts);
      const auto bf16_buf = [&](int64_t n, uint64_t seed, float scale) {
        void* p = nullptr;
        add_buf(keep, p, size_t(n) * 2);
        fill(p, n, seed, scale);
        return p;
      };
      const auto raw = [&](size_t bytes) {
        void* p = nullptr;
        add_buf(keep, p, bytes);
        return p;
      };
      // Inputs: unweighted d_out rows, x rows, the forward's gate/up rows, router weights, weights.
      void* dy = bf16_buf(rows * H, 1, 1.0f);
      void* x = bf16_buf(rows * H, 2, 1.0f);
      void* gu = bf16_buf(rows * n2, 3, 2.0f);
      void* wg = bf16_buf(E * I * H, 4, 0.03f);
      void* wu = bf16_buf(E * I * H, 5, 0.03f);
      void* wd = bf16_buf(E * H * I, 6, 0.03f);
      std::vector<float> weights(static_cast<size_t>(rows), 0.125f);
      auto* rw = static_cast<float*>(raw(size_t(rows) * 4));
      MOK_CUDA_CHECK(cudaMemcpy(rw, weights.data(), size_t(rows) * 4, cudaMemcpyHostToDevice));
      const int64_t parts = gemm::router_parts(I);
      // Outputs (one set per chain, so the two can be compared).
      struct Out {
        void *d_gu, *hw, *dx, *dwd, *dwg, *dwu;
        float* part;
      };
      const auto outs = [&] {
        return Out{raw(size_t(rows * n2) * 2), raw(size_t(rows * I) * 2), raw(size_t(rows * H) * 2),
                   raw(size_t(E * H * I) * 2), raw(size_t(E * I * H) * 2), raw(size_t(E * I * H) * 2),
                   static_cast<float*>(raw(size_t(rows * parts) * 4))};
      };
      const Out ob = outs(), o8 = outs();
      gemm::Options o;
      // BF16 chain.
      gemm::DgradSwiGLUArgs ds{dy, wd, gu, ob.d_gu, H, I, E, d_te, rows / 128, rw, ob.part, ob.hw};
      gemm::DgradArgs d1{ob.d_gu, wg, ob.dx, n2, H, E, d_te, rows / 128, wu};
      gemm::WgradArgs w2{};
      w2.a = dy, w2.b = ob.hw, w2.dw = ob.dwd, w2.m = H, w2.n = I, w2.experts = E, w2.rows_total = rows;
      w2.expert_row_begin = d_beg, w2.expert_rows = d_cnt;
      gemm::WgradArgs w1 = w2;
      w1.a = ob.d_gu, w1.b = x, w1.dw = ob.dwg, w1.dw_up = ob.dwu, w1.m = n2, w1.n = H;
      const gemm::Plan p_ds = gemm::plan_dgrad_swiglu(ds, o), p_d1 = gemm::plan_dgrad(d1, o);
      const gemm::Plan p_w2 = gemm::plan_wgrad(w2, o), p_w1 = gemm::plan_wgrad(w1, o);
      const std::vector<Step> bf16_steps = {{"dgrad_swiglu", [&] { gemm::run(p_ds, nullptr); }},
                                            {"dgrad_fc1", [&] { gemm::run(p_d1, nullptr); }},
                                            {"wgrad_fc2", [&] { gemm::run(p_w2, nullptr); }},
                                            {"wgrad_fc1", [&] { gemm::run(p_w1, nullptr); }}};
      // FP8: the weights' K-major codes (W_down^T [E, I, H]; [W_gate; W_up]^T packed [E, H, 2I]).
      void* wt_tmp = raw(size_t(E * H * n2) * 2);
      void *q_wd = raw(size_t(E * H * I)), *q_w1 = raw(size_t(E * H * n2));
      auto* s_wd = static_cast<float*>(raw(size_t(E * (I / 128) * (H / 128)) * 4));
      auto* s_w1 = static_cast<float*>(raw(size_t(E * (H / 128) * (n2 / 128)) * 4));
      // One pass each (gemm::quantize_fp8_weights_t); the two-step path it replaces (a bf16
      // transpose, then the 128 x 128 quantizer) is timed beside it: the same bits (GPU test).
      const std::vector<Step> weight_steps = {
          {"weights", [&] {
             gemm::quantize_fp8_weights_t(wd, nullptr, E, H, I, fp8::ScaleRule::Fp32, q_wd, s_wd, nullptr);
             gemm::quantize_fp8_weights_t(wg, wu, E, I, H, fp8::ScaleRule::Fp32, q_w1, s_w1, nullptr);
           }}};
      const std::vector<Step> weight_two_step = {
          {"weights_two_step", [&] {
             gemm::transpose_weights_bf16(wd, nullptr, E, H, I, wt_tmp, nullptr);
             gemm::quantize_fp8_blocked(wt_tmp, E * I, H, 128, fp8::ScaleRule::Fp32, q_wd, s_wd, nullptr);
             gemm::transpose_weights_bf16(wg, wu, E, I, H, wt_tmp, nullptr);
             gemm::quantize_fp8_blocked(wt_tmp, E * H, n2, 128, fp8::ScaleRule::Fp32, q_w1, s_w1, nullptr);
           }}};
      for (const auto& s : weight_steps) s.second();
      // FP8 activations' codes.
      void *q_dy = raw(size_t(rows * H)), *q_dgu = raw(size_t(rows * n2));
      auto* s_dy = static_cast<float*>(raw(size_t(rows * H / 128) * 4));
      auto* s_dgu = static_cast<float*>(raw(size_t(rows * n2 / 128) * 4));
      void *t_dy = raw(size_t(rows * H)), *t_hw = raw(size_t(rows * I)), *t_dgu = raw(size_t(rows * n2)),
           *t_x = raw(size_t(rows * H));
      auto* ts_dy = static_cast<float*>(raw(size_t(rows / 128 * H) * 4));
      auto* ts_hw = static_cast<float*>(raw(size_t(rows / 128 * I) * 4));
      auto* ts_dgu = static_cast<float*>(raw(size_t(rows / 128 * n2) * 4));
      auto* ts_x = static_cast<float*>(raw(size_t(rows / 128 * H) * 4));
      const gemm::RoutedSegments seg{d_te, d_beg, d_cnt, rows / 128};
      // x read through the layer's gather (rank 0's row r is routed row r; every row is data here).
      std::vector<int32_t> identity(static_cast<size_t>(rows)), zeros(static_cast<size_t>(rows), 0);
      for (int64_t r = 0; r < rows; ++r) identity[size_t(r)] = int32_t(r);
      void* x_peers = raw(sizeof(void*));
      MOK_CUDA_CHECK(cudaMemcpy(x_peers, &x, sizeof(void*), cudaMemcpyHostToDevice));
      gemm::RowGather xg;
      xg.peers = static_cast<const void* const*>(x_peers);
      xg.src_rank = dev_i32(zeros);
      xg.src_slot = dev_i32(identity);
      xg.top_k = 1;
      gemm::Fp8DgradSwiGLUArgs fs;
      fs.dy = q_dy, fs.dy_scales = s_dy, fs.w_down_t = q_wd, fs.w_down_t_scales = s_wd, fs.gu = gu, fs.d_gu = o8.d_gu;
      fs.hidden = H, fs.inter = I, fs.experts = E, fs.tile_expert = d_te, fs.num_m_tiles = rows / 128;
      fs.row_weight = rw, fs.router_partial = o8.part, fs.h = o8.hw;
      gemm::Fp8GroupedArgs f1;
      f1.a = q_dgu, f1.a_scales = s_dgu, f1.w = q_w1, f1.w_scales = s_w1, f1.y = o8.dx, f1.k = n2, f1.n = H;
      f1.experts = E, f1.tile_expert = d_te, f1.num_m_tiles = rows / 128;
      gemm::Fp8WgradArgs fw2;
      fw2.a_t = t_dy, fw2.a_scales = ts_dy, fw2.b_t = t_hw, fw2.b_scales = ts_hw, fw2.dw = o8.dwd;
      fw2.m_out = H, fw2.n = I, fw2.experts = E, fw2.rows_total = rows, fw2.expert_row_begin = d_beg;
      fw2.expert_rows = d_cnt;
      gemm::Fp8WgradArgs fw1 = fw2;
      fw1.a_t = t_dgu, fw1.a_scales = ts_dgu, fw1.b_t = t_x, fw1.b_scales = ts_x, fw1.dw = o8.dwg, fw1.dw_up = o8.dwu;
      fw1.m_out = n2, fw1.n = H;
      const gemm::Plan q_ds = gemm::plan_fp8_dgrad_swiglu(fs, o), q_d1 = gemm::plan_fp8_grouped(f1, o);
      const gemm::Plan q_w2 = gemm::plan_fp8_wgrad(fw2, o), q_w1p = gemm::plan_fp8_wgrad(fw1, o);
      const auto rule = fp8::ScaleRule::Fp32;
      const std::vector<Step> fp8_steps = {
          // As the layer's FP8 backward runs them: d_y's and d_gu's two forms in one pass each.
          {"quantize_dy", [&] {
             gemm::quantize_fp8_rows_and_token_blocks_t(dy, rows, H, rule, q_dy, s_dy, t_dy, ts_dy, nullptr, seg);
           }},
          {"dgrad_swiglu", [&] { gemm::run(q_ds, nullptr); }},
          {"quantize_dgu", [&] {
             gemm::quantize_fp8_rows_and_token_blocks_t(o8.d_gu, rows, n2, rule, q_dgu, s_dgu, t_dgu, ts_dgu, nullptr,
                                                        seg);
           }},
          {"dgrad_fc1", [&] { gemm::run(q_d1, nullptr); }},
          {"token_blocks", [&] {  // x's rows read where they live (here: x itself, row r = token r)
             gemm::quantize_fp8_token_blocks_t(o8.hw, rows, I, t_hw, ts_hw, nullptr, seg);
             gemm::quantize_fp8_token_blocks_t_gather(xg, rows, H, t_x, ts_x, nullptr, seg);
           }},
          {"wgrad_fc2", [&] { gemm::run(q_w2, nullptr); }},
          {"wgrad_fc1", [&] { gemm::run(q_w1p, nullptr); }}};
      // The same chain with a pass per form and operand (the layer's until 2026-12-03; the same
      // bits): the A/B of the one-pass operands in every run.
      const std::vector<Step> fp8_two_pass_steps = {
          {"quantize_dy", [&] { gemm::quantize_fp8_blocked(dy, rows, H, 1, rule, q_dy, s_dy, nullptr); }},
          {"dgrad_swiglu", [&] { gemm::run(q_ds, nullptr); }},
          {"quantize_dgu", [&] { gemm::quantize_fp8_blocked(o8.d_gu, rows, n2, 1, rule, q_dgu, s_dgu, nullptr); }},
          {"dgrad_fc1", [&] { gemm::run(q_d1, nullptr); }},
          {"token_blocks", [&] {
             gemm::quantize_fp8_token_blocks_t(dy, rows, H, t_dy, ts_dy, nullptr, seg);
             gemm::quantize_fp8_token_blocks_t(o8.hw, rows, I, t_hw, ts_hw, nullptr, seg);
             gemm::quantize_fp8_token_blocks_t(o8.d_gu, rows, n2, t_dgu, ts_dgu, nullptr, seg);
             gemm::quantize_fp8_token_blocks_t(x, rows, H, t_x, ts_x, nullptr, seg);
           }},
          {"wgrad_fc2", [&] { gemm::run(q_w2, nullptr); }},
          {"wgrad_fc1", [&] { gemm::run(q_w1p, nullptr); }}};
      const Result rb = run_chain(bf16_steps, reps), r8 = run_chain(fp8_steps, reps);
      const Result r8p = run_chain(fp8_two_pass_steps, reps);
      const Result rwt = run_chain(weight_steps, reps), rw2 = run_chain(weight_two_step, reps);
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      const double flops = 2.0 * double(rows) * double(H) * double(I) * 6.0;  // 3 GEMMs' dgrads + wgrads
      const double e_dx = rel_diff(o8.dx, ob.dx, rows * H), e_dwd = rel_diff(o8.dwd, ob.dwd, E * H * I),
                   e_dwg = rel_diff(o8.dwg, ob.dwg, E * I * H), e_dgu = rel_diff(o8.d_gu, ob.d_gu, rows * n2);
      std::printf("%-22s bf16 %8.3f ms (%6.1f TF/s)  fp8 %8.3f ms (%6.1f TF/s) = %.3fx  (+ weights %.3f ms: %.3fx)  "
                  "fp8 vs bf16: dx %.1e dW_down %.1e dW_gate %.1e d_gu %.1e\n",
                  name.c_str(), rb.chain_ms, flops / rb.chain_ms * 1e-9, r8.chain_ms, flops / r8.chain_ms * 1e-9,
                  rb.chain_ms / r8.chain_ms, rwt.chain_ms, rb.chain_ms / (r8.chain_ms + rwt.chain_ms), e_dx, e_dwd, e_dwg,
                  e_dgu);
      const auto steps_json = [](const Result& r) {
        std::string s;
        for (const auto& [k, v] : r.steps) s += (s.empty() ? "" : ", ") + ("\"" + k + "\": " + std::to_string(v));
        return "{" + s + "}";
      };
      for (const auto& [k, v] : r8.steps) std::printf("    fp8 %-14s %8.3f ms\n", k.c_str(), v);
      std::printf("    fp8 with a pass per form: %.3f ms (", r8p.chain_ms);
      for (const auto& [k, v] : r8p.steps) std::printf(" %s %.3f", k.c_str(), v);
      std::printf(" )\n");
      std::printf("    fp8 weights        %8.3f ms (one pass; two-step %.3f ms)\n", rwt.chain_ms, rw2.chain_ms);
      for (const auto& [k, v] : rb.steps) std::printf("    bf16 %-13s %8.3f ms\n", k.c_str(), v);
      std::fprintf(f,
                   "%s {\"model\": \"%s\", \"rows_per_expert\": %lld, \"experts\": %lld, \"hidden\": %lld, \"inter\": %lld, "
                   "\"flops\": %.6e, \"bf16_ms\": %.6f, \"fp8_ms\": %.6f, \"fp8_weights_ms\": %.6f, "
                   "\"fp8_weights_two_step_ms\": %.6f, \"x_bf16\": %.4f, "
                   "\"x_bf16_with_weights\": %.4f, \"bf16_steps_ms\": %s, \"fp8_steps_ms\": %s, "
                   "\"fp8_two_pass_ms\": %.6f, \"fp8_two_pass_steps_ms\": %s, "
                   "\"fp8_vs_bf16_rel\": {\"dx\": %.3e, \"dw_down\": %.3e, \"dw_gate\": %.3e, \"d_gu\": %.3e}}",
                   first ? "" : ",\n", m.name, (long long)per, (long long)E, (long long)H, (long long)I, flops, rb.chain_ms,
                   r8.chain_ms, rwt.chain_ms, rw2.chain_ms, rb.chain_ms / r8.chain_ms, rb.chain_ms / (r8.chain_ms + rwt.chain_ms),
                   steps_json(rb).c_str(), steps_json(r8).c_str(), r8p.chain_ms, steps_json(r8p).c_str(), e_dx, e_dwd,
                   e_dwg, e_dgu);
      first = false;
      std::fflush(f);
    }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  if (first) {  // nothing ran: an empty results file must not pass for a measurement
    std::fprintf(stderr, "%s: no case ran (filter '%s' matched none, or every case failed); %s has no cases\n", argv[0],
                 filter.c_str(), out_path.c_str());
    return 1;
  }
  return 0;
}
