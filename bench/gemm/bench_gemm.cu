// mok_gemm_bench — grouped GEMM engine throughput on one GPU.
//
// For each case (model shape x form x rows per expert x routing) it builds the schedule's row
// layout (experts contiguous, padded to 128 rows), fills every buffer with random bf16 on the
// device, checks 256 sampled outputs against an fp64 dot product (correctness before timing),
// then times the kernel with CUDA events (warm-up, then the median over batches of back-to-back
// launches; buffer sets rotate when one set would fit in L2). Writes one JSON file with every case, including the exact
// per-expert row counts, which torch_baseline.py reads to time torch._grouped_mm on the same
// problems in the same device call.
//
//   mok_gemm_bench --out mok.json [--quick] [--filter SUBSTR] [--reps N] [--group-m N] [--group-experts 0|1] [--max-ctas N]
//                  [--no-gu] [--skew N] [--block-n 0|128|256] [--cluster 0|1] [--split-n 0|1] [--pdl 0|1]
//                  [--wgrad-accumulate 0|1] (bf16 wgrad cases added to fp32 gradients: its cost)
//                  [--rows N,N,... (rows per expert; default 128,512,2048)]
//   (knobs for experiments: tile raster group, persistent CTAs, FC1 without g/u, consumer stagger,
//   tile width, 2-CTA clusters, split-N for tiles with <= 64 token rows, programmatic dependent
//   launch)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "util/parse_number.h"
#include "common/cuda_check.h"
#include "common/fp8_format.h"
#include "mok/bf16.hpp"
#include "mok/gemm.hpp"
#include "mok/workload.hpp"
#include "bench_gemm_util.cuh"

namespace {

namespace gemm = mok::gemm;
using namespace mok::bench_gemm;

struct Model {
  const char* name;
  int64_t hidden, inter, experts;  // experts: local experts of one rank at EP8
};
const Model kModels[] = {
    {"dsv3", 7168, 2048, 32},
    {"qwen3-30b-a3b", 2048, 768, 16},
    {"qwen3-235b-a22b", 4096, 1536, 16},
};

struct Case {
  std::string name, form, routing;
  const Model* model;
  int64_t rows_per_expert;
  // GEMM view: out[M, N] with reduction K (wgrad: out [E, M, N] per expert, K = rows)
  int64_t m_or_rows = 0, n = 0, k = 0;
};

struct Result {
  double ms = 0, tflops = 0, err = 0;
  double flops = 0;
  int sets = 1, launches = 0, block_n = 0, skew = 0;
};

struct Knobs {
  int group_m = gemm::Options{}.group_m;
  bool group_experts = gemm::Options{}.group_experts;  // M-grouped raster groups split at experts
  int max_ctas = 0;
  bool store_gu = true;
  int skew = gemm::Options{}.skew_stages;  // the library's defaults unless a knob says otherwise
  int block_n = gemm::Options{}.block_n;
  bool cluster = gemm::Options{}.cluster;
  bool split_n = gemm::Options{}.split_n;  // FC1/FC2 get the experts' rows (split-N for nearly empty tiles)
  bool pdl = gemm::Options{}.pdl;          // programmatic dependent launch between the timed launches
  bool wgrad_accumulate = false;           // bf16 wgrad: added to fp32 gradients (WgradArgs::accumulate)
};

Result run_case(const Case& c, const std::vector<int32_t>& counts, int reps, const Knobs& kn) {
  const Model& md = *c.model;
  const int64_t E = md.experts;
  std::vector<int32_t> begin, tile_expert;
  int64_t rows = 0, real_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    begin.push_back(int32_t(rows));
    const int64_t t = (counts[size_t(e)] + 127) / 128;
    for (int64_t i = 0; i < t; ++i) tile_expert.push_back(int32_t(e));
    rows += t * 128;
    real_rows += counts[size_t(e)];
  }
  const int64_t tiles = rows / 128;
  Buf d_te(tile_expert.size() * 4), d_beg(size_t(E) * 4), d_cnt(size_t(E) * 4);
  MOK_CUDA_CHECK(cudaMemcpy(d_te.p, tile_expert.data(), tile_expert.size() * 4, cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaMemcpy(d_beg.p, begin.data(), size_t(E) * 4, cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaMemcpy(d_cnt.p, counts.data(), size_t(E) * 4, cudaMemcpyHostToDevice));

  // Operand shapes: A [rows, ka] routed, W [E, ., .] weights, outputs.
  int64_t a_cols = 0, w_elems = 0, out_elems = 0, out2_elems = 0, b_cols = 0;
  const int64_t H = md.hidden, I = md.inter;
  if (c.form == "fc1") {
    a_cols = H; w_elems = E * 2 * I * H; out_elems = rows * I; out2_elems = rows * 2 * I;
  } else if (c.form == "fc1_fp8") {  // E4M3 codes (one byte each: the buffers half used); out = h codes, out2 = h scales
    a_cols = H; w_elems = E * 2 * I * H; out_elems = rows * I; out2_elems = rows * (I / 128) * 2;
  } else if (c.form == "fc2" || c.form == "fc2_fp8") {  // fp8: one byte per element (the bf16 buffers half used)
    a_cols = I; w_elems = E * H * I; out_elems = rows * H;
  } else if (c.form == "dgrad_fp8") {  // the plain FP8 form on a dgrad's shape: W = the weights' codes transposed
    a_cols = c.k; w_elems = E * c.n * c.k; out_elems = rows * c.n;
  } else if (c.form == "dgrad" || c.form == "dgrad_fc1") {  // dgrad_fc1: W = w_gate then w_up
    a_cols = c.k; w_elems = E * c.k * c.n; out_elems = rows * c.n;
  } else if (c.form == "dgrad_swiglu" || c.form == "dgrad_swiglu_fp8") {  // d_y [rows, H], W_down [E, H, I], gu and
    // d_gu [rows, 2I] (fp8: d_y's codes, W_down^T's codes [E, I, H])
    a_cols = H; w_elems = E * H * I; b_cols = 2 * I; out_elems = rows * 2 * I;
  } else {  // wgrad: a [rows, m], b [rows, n], out [E, m, n] (wgrad_fp8: a, b as E4M3 codes transposed)
    a_cols = c.m_or_rows; b_cols = c.n; out_elems = E * c.m_or_rows * c.n;
  }
  const int64_t set_bytes = (rows * a_cols + w_elems + rows * b_cols) * 2;
  const int sets = int(std::clamp<int64_t>((256ll << 20) / std::max<int64_t>(set_bytes, 1) + 1, 1, 4));
  const bool fp8 = c.form == "fc2_fp8" || c.form == "fc1_fp8" || c.form == "dgrad_fp8" || c.form == "dgrad_swiglu_fp8";
  const bool wgrad_fp8 = c.form == "wgrad_fp8";
  std::vector<std::unique_ptr<Buf>> A, W, B, SA, SW;  // SA, SW: the FP8 operands' scales (wgrad_fp8: A's, B's)
  for (int s = 0; s < sets; ++s) {
    A.emplace_back(new Buf(size_t(rows * a_cols) * 2));
    if (wgrad_fp8) {  // [m, rows] and [n, rows] codes, scales per 128 x 1 block: [rows / 128, m], [rows / 128, n]
      B.emplace_back(new Buf(size_t(rows * b_cols)));
      fill_e4m3_kernel<<<1024, 256>>>(static_cast<uint8_t*>(A.back()->p), rows * a_cols, 1000 + s);
      fill_e4m3_kernel<<<1024, 256>>>(static_cast<uint8_t*>(B.back()->p), rows * b_cols, 3000 + s);
      SA.emplace_back(new Buf(size_t(rows / 128 * a_cols) * 4));
      SW.emplace_back(new Buf(size_t(rows / 128 * b_cols) * 4));
      fill_scales_kernel<<<256, 256>>>(static_cast<float*>(SA.back()->p), rows / 128 * a_cols, 4000 + s);
      fill_scales_kernel<<<256, 256>>>(static_cast<float*>(SW.back()->p), rows / 128 * b_cols, 5000 + s);
      MOK_CUDA_CHECK(cudaGetLastError());
      continue;
    }
    if (fp8) {
      fill_e4m3_kernel<<<1024, 256>>>(static_cast<uint8_t*>(A.back()->p), rows * a_cols, 1000 + s);
      SA.emplace_back(new Buf(size_t(rows * (a_cols / 128)) * 4));
      fill_scales_kernel<<<256, 256>>>(static_cast<float*>(SA.back()->p), rows * (a_cols / 128), 4000 + s);
    } else {
      fill(A.back()->p, rows * a_cols, 1000 + s, 1.0f);
    }
    if (w_elems) {
      W.emplace_back(new Buf(size_t(w_elems) * 2));
      if (fp8) {
        fill_e4m3_kernel<<<1024, 256>>>(static_cast<uint8_t*>(W.back()->p), w_elems, 2000 + s);
        SW.emplace_back(new Buf(size_t(w_elems / (128 * 128)) * 4));
        fill_scales_kernel<<<256, 256>>>(static_cast<float*>(SW.back()->p), w_elems / (128 * 128), 5000 + s);
      } else {
        fill(W.back()->p, w_elems, 2000 + s, 0.03f);
      }
    }
    MOK_CUDA_CHECK(cudaGetLastError());
    if (b_cols) {
      B.emplace_back(new Buf(size_t(rows * b_cols) * 2));
      fill(B.back()->p, rows * b_cols, 3000 + s, 1.0f);
    }
  }
  const bool acc_f32 = kn.wgrad_accumulate && c.form == "wgrad";  // fp32 output, added to
  Buf out(size_t(out_elems) * (acc_f32 ? 4 : 2)), out2(size_t(std::max<int64_t>(out2_elems, 1)) * 2);
  Buf err(4);
  MOK_CUDA_CHECK(cudaMemset(err.p, 0, 4));
  gemm::Options o;
  o.error = static_cast<unsigned*>(err.p);
  o.wait_limit_s = 2.0;
  o.group_m = kn.group_m;
  o.group_experts = kn.group_experts;
  o.max_ctas = kn.max_ctas;
  o.skew_stages = kn.skew;
  o.block_n = kn.block_n;
  o.cluster = kn.cluster;
  o.split_n = kn.split_n;
  o.pdl = kn.pdl;

  std::vector<gemm::Plan> plans;
  for (int s = 0; s < sets; ++s) {
    if (c.form == "fc1") {
      gemm::Fc1Args a;
      // W holds w_gate [E, I, H] then w_up [E, I, H].
      a.x = A[s]->p; a.w_gate = W[s]->p; a.w_up = static_cast<const uint16_t*>(W[s]->p) + E * I * H; a.h = out.p; a.gu = kn.store_gu ? out2.p : nullptr;
      a.hidden = H; a.inter = I; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      a.expert_row_begin = static_cast<int32_t*>(d_beg.p); a.expert_rows = static_cast<int32_t*>(d_cnt.p);
      plans.push_back(gemm::plan_fc1(a, o));
    } else if (c.form == "fc2") {
      gemm::Fc2Args a;
      a.a = A[s]->p; a.w = W[s]->p; a.y = out.p; a.k = I; a.n = H; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      a.expert_row_begin = static_cast<int32_t*>(d_beg.p); a.expert_rows = static_cast<int32_t*>(d_cnt.p);
      plans.push_back(gemm::plan_fc2(a, o));
    } else if (c.form == "fc1_fp8") {
      // W holds w_gate [E, I, H] then w_up; SW their 128 x 128 scales likewise.
      gemm::Fp8Fc1Args a;
      a.x = A[s]->p; a.x_scales = static_cast<const float*>(SA[s]->p);
      a.w_gate = W[s]->p; a.w_up = static_cast<const uint8_t*>(W[s]->p) + E * I * H;
      a.w_gate_scales = static_cast<const float*>(SW[s]->p);
      a.w_up_scales = static_cast<const float*>(SW[s]->p) + E * I * H / (128 * 128);
      a.h = out.p; a.h_scales = static_cast<float*>(out2.p);
      a.hidden = H; a.inter = I; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      gemm::Options o8 = o;
      o8.block_n = 0;  // FP8's FC1: 256-wide packed tiles
      o8.cluster = false;
      plans.push_back(gemm::plan_fp8_fc1(a, o8));
    } else if (c.form == "dgrad_swiglu_fp8") {
      gemm::Fp8DgradSwiGLUArgs a;
      a.dy = A[s]->p; a.dy_scales = static_cast<const float*>(SA[s]->p);
      a.w_down_t = W[s]->p; a.w_down_t_scales = static_cast<const float*>(SW[s]->p);
      a.gu = B[s]->p; a.d_gu = out.p; a.hidden = H; a.inter = I; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      gemm::Options o8 = o;
      o8.block_n = 0;  // 256-wide tiles
      o8.cluster = false;
      plans.push_back(gemm::plan_fp8_dgrad_swiglu(a, o8));
    } else if (fp8) {
      gemm::Fp8GroupedArgs a;
      a.a = A[s]->p; a.a_scales = static_cast<const float*>(SA[s]->p);
      a.w = W[s]->p; a.w_scales = static_cast<const float*>(SW[s]->p);
      a.y = out.p; a.k = c.k; a.n = c.n; a.experts = E;  // fc2_fp8: k = I, n = H
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      gemm::Options o8 = o;
      o8.block_n = 0;  // FP8: 128- or 256-wide tiles by tile count (or the --block-n knob)
      if (kn.block_n == 128 || kn.block_n == 256) o8.block_n = kn.block_n;
      o8.cluster = false;
      plans.push_back(gemm::plan_fp8_grouped(a, o8));
    } else if (c.form == "dgrad" || c.form == "dgrad_fc1") {
      gemm::DgradArgs a;
      a.dy = A[s]->p; a.w = W[s]->p; a.dx = out.p; a.k = c.k; a.n = c.n; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      if (c.form == "dgrad_fc1") a.w_up = static_cast<const uint16_t*>(W[s]->p) + E * (c.k / 2) * c.n;
      plans.push_back(gemm::plan_dgrad(a, o));
    } else if (c.form == "dgrad_swiglu") {
      gemm::DgradSwiGLUArgs a;
      a.dy = A[s]->p; a.w_down = W[s]->p; a.gu = B[s]->p; a.d_gu = out.p;
      a.hidden = H; a.inter = I; a.experts = E;
      a.tile_expert = static_cast<int32_t*>(d_te.p); a.num_m_tiles = tiles;
      plans.push_back(gemm::plan_dgrad_swiglu(a, o));
    } else if (wgrad_fp8) {
      gemm::Fp8WgradArgs a;
      a.a_t = A[s]->p; a.a_scales = static_cast<const float*>(SA[s]->p);
      a.b_t = B[s]->p; a.b_scales = static_cast<const float*>(SW[s]->p);
      a.dw = out.p; a.m_out = c.m_or_rows; a.n = c.n; a.experts = E; a.rows_total = rows;
      a.expert_row_begin = static_cast<int32_t*>(d_beg.p);
      a.expert_rows = static_cast<int32_t*>(d_cnt.p);
      gemm::Options o8 = o;
      o8.block_n = 0;  // by tile count (or the --block-n knob)
      if (kn.block_n == 128 || kn.block_n == 256) o8.block_n = kn.block_n;
      o8.cluster = false;
      plans.push_back(gemm::plan_fp8_wgrad(a, o8));
    } else {
      gemm::WgradArgs a;
      a.a = A[s]->p; a.b = B[s]->p; a.dw = out.p; a.m = c.m_or_rows; a.n = c.n; a.experts = E;
      a.rows_total = rows;
      a.expert_row_begin = static_cast<int32_t*>(d_beg.p);
      a.expert_rows = static_cast<int32_t*>(d_cnt.p);
      a.accumulate = acc_f32;
      plans.push_back(gemm::plan_wgrad(a, o));
    }
  }

  // Correctness first: 256 sampled outputs of set 0 against fp64 (accumulated into zeros).
  if (acc_f32) MOK_CUDA_CHECK(cudaMemset(out.p, 0, size_t(out_elems) * 4));
  gemm::run(plans[0], nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned e_word = 0;
  MOK_CUDA_CHECK(cudaMemcpy(&e_word, err.p, 4, cudaMemcpyDeviceToHost));
  if (e_word != 0) std::fprintf(stderr, "%s: bounded wait expired (site 0x%x)\n", c.name.c_str(), e_word);
  mok::Rng rng(77 + uint64_t(c.rows_per_expert));
  double d2 = 0, r2 = 0;
  int nonfinite = 0;
  for (int smp = 0; smp < 256; ++smp) {
    int64_t e = 0;
    do e = rng.below(E); while (counts[size_t(e)] == 0);
    const int64_t r = begin[size_t(e)] + rng.below(counts[size_t(e)]);
    double ref = 0, got = 0;
    if (c.form == "fc1") {
      const int64_t i = rng.below(I);
      const auto x = fetch(A[0]->p, r * H, H);
      const auto g = fetch(W[0]->p, (e * I + i) * H, H);
      const auto u = fetch(W[0]->p, E * I * H + (e * I + i) * H, H);
      const double gv = dot_rows(x, g), uv = dot_rows(x, u);
      ref = gv / (1.0 + std::exp(-gv)) * uv;
      got = host_bf16(fetch(out.p, r * I + i, 1)[0]);
    } else if (c.form == "fc2") {
      const int64_t j = rng.below(H);
      ref = dot_rows(fetch(A[0]->p, r * I, I), fetch(W[0]->p, (e * H + j) * I, I));
      got = host_bf16(fetch(out.p, r * H + j, 1)[0]);
    } else if (c.form == "fc1_fp8") {  // h from the decoded operands in fp64, quantized, vs the decoded h code
      const int64_t i = rng.below(I), kb = H / 128;
      std::vector<uint8_t> qa(static_cast<size_t>(H)), qg(static_cast<size_t>(H)), qu(static_cast<size_t>(H));
      std::vector<float> sa(static_cast<size_t>(kb)), sg(static_cast<size_t>(kb)), su(static_cast<size_t>(kb));
      const auto* a8 = static_cast<const uint8_t*>(A[0]->p);
      const auto* w8 = static_cast<const uint8_t*>(W[0]->p);
      const auto* sw = static_cast<const float*>(SW[0]->p);
      MOK_CUDA_CHECK(cudaMemcpy(qa.data(), a8 + r * H, size_t(H), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(qg.data(), w8 + (e * I + i) * H, size_t(H), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(qu.data(), w8 + E * I * H + (e * I + i) * H, size_t(H), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(sa.data(), static_cast<const float*>(SA[0]->p) + r * kb, size_t(kb) * 4,
                                cudaMemcpyDeviceToHost));
      const int64_t wb = (e * (I / 128) + i / 128) * kb;
      MOK_CUDA_CHECK(cudaMemcpy(sg.data(), sw + wb, size_t(kb) * 4, cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(su.data(), sw + E * I * H / (128 * 128) + wb, size_t(kb) * 4, cudaMemcpyDeviceToHost));
      double g = 0, u = 0;
      for (int64_t j = 0; j < H; ++j) {
        const double x = double(mok::fp8::e4m3_decode(qa[size_t(j)])) * sa[size_t(j / 128)];
        g += x * double(mok::fp8::e4m3_decode(qg[size_t(j)])) * sg[size_t(j / 128)];
        u += x * double(mok::fp8::e4m3_decode(qu[size_t(j)])) * su[size_t(j / 128)];
      }
      // FC1's bits: g and u rounded to bf16, h = rnd(silu(g) u) (the epilogue's SFU exp aside).
      const double gb = mok::round_bf16(float(g)), ub = mok::round_bf16(float(u));
      ref = mok::round_bf16(float(gb / (1.0 + std::exp(-gb)) * ub));
      uint8_t code = 0;
      float hs = 0;
      MOK_CUDA_CHECK(cudaMemcpy(&code, static_cast<const uint8_t*>(out.p) + r * I + i, 1, cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(&hs, static_cast<const float*>(out2.p) + r * (I / 128) + i / 128, 4,
                                cudaMemcpyDeviceToHost));
      got = double(mok::fp8::e4m3_decode(code)) * hs;
      // Against h quantized by the spec in the GPU's block scale (Fp8Grouped.Fc1WithQuantizedH
      // checks the scales against the reference's): what is left is accumulation order, not E4M3.
      ref = mok::fp8::block_decode(mok::fp8::block_encode(float(ref), hs), hs);
    } else if (c.form == "dgrad_swiglu_fp8") {  // d_h from the decoded codes in fp64 (rounded to bf16), then as bf16's
      const int64_t i = rng.below(I), kb = H / 128;
      std::vector<uint8_t> qa(static_cast<size_t>(H)), qw(static_cast<size_t>(H));
      std::vector<float> sa(static_cast<size_t>(kb)), sw(static_cast<size_t>(kb));
      MOK_CUDA_CHECK(cudaMemcpy(qa.data(), static_cast<const uint8_t*>(A[0]->p) + r * H, size_t(H), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(qw.data(), static_cast<const uint8_t*>(W[0]->p) + (e * I + i) * H, size_t(H),
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(sa.data(), static_cast<const float*>(SA[0]->p) + r * kb, size_t(kb) * 4,
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(sw.data(), static_cast<const float*>(SW[0]->p) + (e * (I / 128) + i / 128) * kb,
                                size_t(kb) * 4, cudaMemcpyDeviceToHost));
      double dot = 0;
      for (int64_t k = 0; k < H; ++k)
        dot += double(mok::fp8::e4m3_decode(qa[size_t(k)])) * sa[size_t(k / 128)] *
               double(mok::fp8::e4m3_decode(qw[size_t(k)])) * sw[size_t(k / 128)];
      const double dh = host_bf16(mok::bf16::from_float(float(dot)));
      const int64_t pg = r * 2 * I + gemm::packed_gate_row(i), pu = r * 2 * I + gemm::packed_up_row(i);
      const double g = host_bf16(fetch(B[0]->p, pg, 1)[0]), u = host_bf16(fetch(B[0]->p, pu, 1)[0]);
      const double sg = 1.0 / (1.0 + std::exp(-g));
      ref = smp % 2 == 0 ? sg * (1.0 + g * (1.0 - sg)) * u * dh : g * sg * dh;
      got = host_bf16(fetch(out.p, smp % 2 == 0 ? pg : pu, 1)[0]);
    } else if (fp8) {  // the plain form (fc2_fp8, dgrad_fp8): the decoded codes times their scales, in fp64
      const int64_t K = c.k, N = c.n, j = rng.below(N), kb = K / 128;
      std::vector<uint8_t> qa(static_cast<size_t>(K)), qw(static_cast<size_t>(K));
      std::vector<float> sa(static_cast<size_t>(kb)), sw(static_cast<size_t>(kb));
      MOK_CUDA_CHECK(cudaMemcpy(qa.data(), static_cast<const uint8_t*>(A[0]->p) + r * K, size_t(K), cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(qw.data(), static_cast<const uint8_t*>(W[0]->p) + (e * N + j) * K, size_t(K),
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(sa.data(), static_cast<const float*>(SA[0]->p) + r * kb, size_t(kb) * 4,
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(sw.data(), static_cast<const float*>(SW[0]->p) + (e * (N / 128) + j / 128) * kb,
                                size_t(kb) * 4, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < K; ++i)
        ref += double(mok::fp8::e4m3_decode(qa[size_t(i)])) * sa[size_t(i / 128)] *
               double(mok::fp8::e4m3_decode(qw[size_t(i)])) * sw[size_t(i / 128)];
      got = host_bf16(fetch(out.p, r * N + j, 1)[0]);
    } else if (c.form == "dgrad") {
      const int64_t j = rng.below(c.n);
      ref = dot_rows(fetch(A[0]->p, r * c.k, c.k), fetch_strided(W[0]->p, e * c.k * c.n + j, c.n, c.k));
      got = host_bf16(fetch(out.p, r * c.n + j, 1)[0]);
    } else if (c.form == "dgrad_fc1") {
      // Column j of [W_gate; W_up][e] in the packed K order.
      const int64_t j = rng.below(c.n), inter = c.k / 2;
      const auto g = fetch_strided(W[0]->p, e * inter * c.n + j, c.n, inter);
      const auto u = fetch_strided(W[0]->p, (E + e) * inter * c.n + j, c.n, inter);
      std::vector<uint16_t> col(size_t(c.k));
      for (int64_t i = 0; i < inter; ++i) {
        col[size_t(gemm::packed_gate_row(i))] = g[size_t(i)];
        col[size_t(gemm::packed_up_row(i))] = u[size_t(i)];
      }
      ref = dot_rows(fetch(A[0]->p, r * c.k, c.k), col);
      got = host_bf16(fetch(out.p, r * c.n + j, 1)[0]);
    } else if (c.form == "dgrad_swiglu") {
      // d_h in fp64 (rounded to bf16, as the reference), then d_g (even samples) or d_u (odd).
      const int64_t i = rng.below(I);
      const double dh = host_bf16(mok::bf16::from_float(
          float(dot_rows(fetch(A[0]->p, r * H, H), fetch_strided(W[0]->p, e * H * I + i, I, H)))));
      const int64_t pg = r * 2 * I + gemm::packed_gate_row(i), pu = r * 2 * I + gemm::packed_up_row(i);
      const double g = host_bf16(fetch(B[0]->p, pg, 1)[0]), u = host_bf16(fetch(B[0]->p, pu, 1)[0]);
      const double sg = 1.0 / (1.0 + std::exp(-g));
      ref = smp % 2 == 0 ? sg * (1.0 + g * (1.0 - sg)) * u * dh : g * sg * dh;
      got = host_bf16(fetch(out.p, smp % 2 == 0 ? pg : pu, 1)[0]);
    } else if (wgrad_fp8) {  // K = the expert's whole 128-row blocks, as the kernel (padding rows included:
      // the random codes are nonzero there, where a real layout has zero codes)
      const int64_t i = rng.below(c.m_or_rows), j = rng.below(c.n), b0 = begin[size_t(e)];
      const int64_t kr = (counts[size_t(e)] + 127) / 128 * 128;
      std::vector<uint8_t> qa(static_cast<size_t>(kr)), qb(static_cast<size_t>(kr));
      MOK_CUDA_CHECK(cudaMemcpy(qa.data(), static_cast<const uint8_t*>(A[0]->p) + i * rows + b0, size_t(kr),
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(qb.data(), static_cast<const uint8_t*>(B[0]->p) + j * rows + b0, size_t(kr),
                                cudaMemcpyDeviceToHost));
      for (int64_t blk = 0; blk < kr / 128; ++blk) {
        float sa = 0, sb = 0;
        MOK_CUDA_CHECK(cudaMemcpy(&sa, static_cast<const float*>(SA[0]->p) + (b0 / 128 + blk) * c.m_or_rows + i, 4,
                                  cudaMemcpyDeviceToHost));
        MOK_CUDA_CHECK(cudaMemcpy(&sb, static_cast<const float*>(SW[0]->p) + (b0 / 128 + blk) * c.n + j, 4,
                                  cudaMemcpyDeviceToHost));
        for (int64_t r = 128 * blk; r < 128 * (blk + 1); ++r)
          ref += double(mok::fp8::e4m3_decode(qa[size_t(r)])) * sa * double(mok::fp8::e4m3_decode(qb[size_t(r)])) * sb;
      }
      got = host_bf16(fetch(out.p, (e * c.m_or_rows + i) * c.n + j, 1)[0]);
    } else {
      const int64_t i = rng.below(c.m_or_rows), j = rng.below(c.n);
      const int64_t b0 = begin[size_t(e)], cnt = counts[size_t(e)];
      ref = dot_rows(fetch_strided(A[0]->p, b0 * c.m_or_rows + i, c.m_or_rows, cnt),
                     fetch_strided(B[0]->p, b0 * c.n + j, c.n, cnt));
      const int64_t at = (e * c.m_or_rows + i) * c.n + j;
      if (acc_f32) {
        float f = 0;
        MOK_CUDA_CHECK(cudaMemcpy(&f, static_cast<const float*>(out.p) + at, 4, cudaMemcpyDeviceToHost));
        got = f;
      } else {
        got = host_bf16(fetch(out.p, at, 1)[0]);
      }
    }
    if (!std::isfinite(got)) ++nonfinite;
    else {
      d2 += (got - ref) * (got - ref);
      r2 += ref * ref;
    }
  }
  Result res;
  res.block_n = plans[0].block_n;
  res.skew = plans[0].params.skew_stages;  // the stagger it ran (-1 resolved to the form's default)
  res.err = nonfinite ? INFINITY : std::sqrt(d2 / std::max(r2, 1e-300));
  res.sets = sets;
  if (e_word != 0) {  // a broken pipeline: do not spend seconds per launch timing it
    res.err = INFINITY;
    res.ms = NAN;
    return res;
  }

  // Timing: warm-up, then batches of back-to-back launches between two events (so host launch
  // overhead overlaps the GPU and is not counted), the per-launch time of each batch, median over
  // batches. A batch lasts ~2 ms or at least 3 launches; `reps` launches in all (>= 5 batches).
  cudaEvent_t t0, t1;
  MOK_CUDA_CHECK(cudaEventCreate(&t0));
  MOK_CUDA_CHECK(cudaEventCreate(&t1));
  auto time_batch = [&](int n, int first) {
    MOK_CUDA_CHECK(cudaEventRecord(t0));
    for (int i = 0; i < n; ++i) gemm::run(plans[size_t((first + i) % sets)], nullptr);
    MOK_CUDA_CHECK(cudaEventRecord(t1));
    MOK_CUDA_CHECK(cudaEventSynchronize(t1));
    float t = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&t, t0, t1));
    return t / float(n);
  };
  const float est = time_batch(3, 0);  // also the warm-up
  const int per_batch = int(std::clamp(2.0f / std::max(est, 1e-3f), 3.0f, 50.0f));
  const int batches = std::max(5, reps / per_batch);
  std::vector<float> ms;
  for (int b = 0; b < batches; ++b) ms.push_back(time_batch(per_batch, b * per_batch));
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  std::sort(ms.begin(), ms.end());
  res.ms = ms[ms.size() / 2];
  res.launches = batches * per_batch;
  // Useful FLOPs: real rows only (padding rows are mok's overhead).
  if (c.form == "fc1" || c.form == "fc1_fp8") res.flops = 2.0 * double(real_rows) * double(2 * I) * double(H);
  else if (c.form == "fc2") res.flops = 2.0 * double(real_rows) * double(H) * double(I);
  else if (fp8) res.flops = 2.0 * double(real_rows) * double(c.n) * double(c.k);  // fc2_fp8: n = H, k = I
  else if (c.form == "dgrad" || c.form == "dgrad_fc1" || c.form == "dgrad_swiglu")
    res.flops = 2.0 * double(real_rows) * double(c.n) * double(c.k);
  else res.flops = 2.0 * double(real_rows) * double(c.m_or_rows) * double(c.n);
  res.tflops = res.flops / (res.ms * 1e-3) / 1e12;
  MOK_CUDA_CHECK(cudaMemcpy(&e_word, err.p, 4, cudaMemcpyDeviceToHost));
  if (e_word != 0) res.err = INFINITY;
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "mok_gemm.json", filter;
  bool quick = false;
  int reps = 30;
  std::vector<int64_t> row_set = {128, 512, 2048};  // rows per expert of every case
  Knobs kn;
  using mok::bench::parse_number;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has = i + 1 < argc;
      if (a == "--out" && has) out_path = argv[++i];
      else if (a == "--filter" && has) filter = argv[++i];
      else if (a == "--reps" && has) reps = parse_number("--reps", argv[++i], 1, 100000);
      else if (a == "--quick") quick = true;
      else if (a == "--group-m" && has) kn.group_m = parse_number("--group-m", argv[++i], 1, 1 << 20);
      else if (a == "--group-experts" && has)
        kn.group_experts = parse_number("--group-experts", argv[++i], 0, 1) != 0;
      else if (a == "--max-ctas" && has) kn.max_ctas = parse_number("--max-ctas", argv[++i], 0, 1 << 20, " (0 = all SMs)");
      else if (a == "--no-gu") kn.store_gu = false;
      else if (a == "--skew" && has) kn.skew = parse_number("--skew", argv[++i], -1, 64, " (-1 = the library's default)");
      else if (a == "--block-n" && has) kn.block_n = parse_number("--block-n", argv[++i], 0, 256, " (0, 128 or 256)");
      else if (a == "--cluster" && has) kn.cluster = parse_number("--cluster", argv[++i], 0, 1) != 0;
      else if (a == "--split-n" && has) kn.split_n = parse_number("--split-n", argv[++i], 0, 1) != 0;
      else if (a == "--pdl" && has) kn.pdl = parse_number("--pdl", argv[++i], 0, 1) != 0;
      else if (a == "--wgrad-accumulate" && has)
        kn.wgrad_accumulate = parse_number("--wgrad-accumulate", argv[++i], 0, 1) != 0;
      else if (a == "--rows" && has) {  // a comma-separated list of rows per expert
        row_set.clear();
        std::string list = argv[++i];
        for (size_t at = 0; at <= list.size();) {
          const size_t comma = std::min(list.find(',', at), list.size());
          row_set.push_back(parse_number<int64_t>("--rows", list.substr(at, comma - at), 128, 1 << 20, " (rows per expert)"));
          at = comma + 1;
        }
      }
      else {
        std::fprintf(stderr,
                     "usage: %s [--out FILE] [--filter SUBSTR] [--reps N] [--quick] [--group-m N] [--group-experts 0|1] [--max-ctas N] "
                     "[--no-gu] [--skew N] [--block-n 0|128|256] [--cluster 0|1] [--split-n 0|1] [--pdl 0|1] [--wgrad-accumulate 0|1] [--rows N,N,...]\n",
                     argv[0]);
        return 2;
      }
    }
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  std::vector<Case> cases;
  for (const Model& m : kModels) {
    for (const char* routing : {"uniform", "skewed"})
      for (int64_t r : row_set)
        for (const char* form : {"fc1", "fc2", "fc1_fp8", "fc2_fp8"}) {
          Case c;
          c.model = &m;
          c.form = form;
          c.routing = routing;
          c.rows_per_expert = r;
          c.name = std::string(m.name) + "-" + form;
          if ((c.form == "fc1_fp8" || c.form == "fc2_fp8") && std::string(routing) != "uniform") continue;
          if (c.form == "fc1" || c.form == "fc1_fp8") { c.n = 2 * m.inter; c.k = m.hidden; }
          else { c.n = m.hidden; c.k = m.inter; }
          cases.push_back(c);
        }
    // Backward forms, uniform routing.
    for (int64_t r : row_set) {
      const bool big = std::string(m.name) == "dsv3";
      if (!big && r != 512) continue;
      Case c;
      c.model = &m;
      c.routing = "uniform";
      c.rows_per_expert = r;
      c.form = "dgrad";  // d_h = d_y . W_down[e]   (K = hidden, N = inter)
      c.name = std::string(m.name) + "-dgrad-fc2"; c.k = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.form = "dgrad_swiglu";  // d_gu = SwiGLU'(gu, d_y . W_down[e])   (K = hidden, N = inter)
      c.name = std::string(m.name) + "-dgrad-fc2-swiglu"; c.k = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.form = "dgrad_fc1";  // d_x = d_gu . [W_gate; W_up][e]: K blocks from both weights
      c.name = std::string(m.name) + "-dgrad-fc1"; c.k = 2 * m.inter; c.n = m.hidden;
      cases.push_back(c);
      // The FP8 dgrads a backward in FP8 would run (notes/fp8.md): the plain FP8 form with d_y (or
      // d_gu) per 1x128 and the weights' 128x128-block codes transposed (K-major), bf16 out; their
      // BF16 twins are the two cases above.
      c.form = "dgrad_fp8";
      c.name = std::string(m.name) + "-dgrad-fc2_fp8"; c.k = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.form = "dgrad_swiglu_fp8";  // the FP8 dgrad the FP8 backward runs for FC2 (gemm::plan_fp8_dgrad_swiglu)
      c.name = std::string(m.name) + "-dgrad-fc2-swiglu_fp8"; c.k = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.form = "dgrad_fp8";
      c.name = std::string(m.name) + "-dgrad-fc1_fp8"; c.k = 2 * m.inter; c.n = m.hidden;
      cases.push_back(c);
      c.form = "wgrad";  // dW_down[e] = d_y^T h   (M = hidden, N = inter)
      c.name = std::string(m.name) + "-wgrad-fc2"; c.m_or_rows = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.name = std::string(m.name) + "-wgrad-fc1"; c.m_or_rows = 2 * m.inter; c.n = m.hidden;  // dW1p[e] = d_gu^T x
      cases.push_back(c);
      // Their FP8 twins (gemm::plan_fp8_wgrad): both operands per 128 x 1 block, transposed codes.
      c.form = "wgrad_fp8";
      c.name = std::string(m.name) + "-wgrad-fc2_fp8"; c.m_or_rows = m.hidden; c.n = m.inter;
      cases.push_back(c);
      c.name = std::string(m.name) + "-wgrad-fc1_fp8"; c.m_or_rows = 2 * m.inter; c.n = m.hidden;
      cases.push_back(c);
    }
  }

  FILE* f = std::fopen(out_path.c_str(), "w");
  if (!f) {
    std::perror(out_path.c_str());
    return 1;
  }
  std::fprintf(f, "{\"device\": \"%s\", \"sms\": %d, \"cases\": [\n", prop.name, prop.multiProcessorCount);
  bool first = true;
  std::printf("%-32s %-12s %5s %-8s %10s %9s %9s\n", "case", "form", "rows", "routing", "ms", "TFLOP/s", "rel_err");
  for (const Case& c : cases) {
    const std::string key = c.name + "/" + c.routing + "/" + std::to_string(c.rows_per_expert);
    if (!filter.empty() && key.find(filter) == std::string::npos) continue;
    if (quick && !(c.rows_per_expert == 512 && c.routing == "uniform")) continue;
    const auto counts = expert_counts(c.model->experts, c.rows_per_expert, c.routing);
    Result r;
    try {
      r = run_case(c, counts, reps, kn);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "%s: %s\n", key.c_str(), ex.what());
      continue;
    }
    std::printf("%-32s %-12s %5lld %-8s %10.4f %9.1f %9.2e  bn=%d\n", c.name.c_str(), c.form.c_str(),
                (long long)c.rows_per_expert, c.routing.c_str(), r.ms, r.tflops, r.err, r.block_n);
    std::fflush(stdout);
    std::fprintf(f, "%s  {\"name\": \"%s\", \"form\": \"%s\", \"rows_per_expert\": %lld, \"routing\": \"%s\", "
                 "\"experts\": %lld, \"hidden\": %lld, \"inter\": %lld, \"m\": %lld, \"n\": %lld, \"k\": %lld, "
                 "\"flops\": %.6e, \"mok_ms\": %.6f, \"mok_tflops\": %.3f, \"check_rel_err\": %.3e, "
                 "\"buffer_sets\": %d, \"timed_launches\": %d, \"block_n\": %d, \"skew\": %d, \"group_m\": %d, "
                 "\"group_experts\": %d, \"cluster\": %d, \"split_n\": %d, \"pdl\": %d, \"wgrad_accumulate\": %d, \"counts\": [",
                 first ? "" : ",\n", c.name.c_str(), c.form.c_str(), (long long)c.rows_per_expert,
                 c.routing.c_str(), (long long)c.model->experts, (long long)c.model->hidden,
                 (long long)c.model->inter, (long long)c.m_or_rows, (long long)c.n, (long long)c.k, r.flops,
                 r.ms, r.tflops, std::isfinite(r.err) ? r.err : -1.0, r.sets, r.launches, r.block_n, r.skew, kn.group_m, int(kn.group_experts), int(kn.cluster),
                 int(kn.split_n), int(kn.pdl), int(kn.wgrad_accumulate && c.form == "wgrad"));
    for (size_t i = 0; i < counts.size(); ++i) std::fprintf(f, "%s%d", i ? ", " : "", counts[i]);
    std::fprintf(f, "]}");
    first = false;
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
