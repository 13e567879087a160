#include "reference/token_spec.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "mok/bf16.hpp"
#include "reference/cpu_math.h"
#include "reference/fp8_quant.h"

namespace mok::ref {

namespace {
// Values replaced by what their block-scaled E4M3 codes decode to (fp32 scales amax / 448; with
// MXFP8 the MX blocks, 1 x 32 with E8M0 scales, whatever `block` says), in place. Rows of blocks
// are independent, so a large matrix (an expert's weights: 44 M values for DeepSeek-V3, ~0.4 s on
// one core) is split into slabs of block rows over the machine's threads.
void fp8_round_slab(float* v, int64_t rows, int64_t cols, fp8::BlockShape block, Precision p) {
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  if (p == Precision::MXFP8) {
    std::vector<uint8_t> s(static_cast<size_t>(fp8::scale_count(rows, cols, fp8::kMxBlockShape)));
    fp8::quantize_mxfp8(v, rows, cols, q.data(), s.data());
    fp8::dequantize_mxfp8(q.data(), s.data(), rows, cols, v);
    return;
  }
  std::vector<float> s(static_cast<size_t>(fp8::scale_count(rows, cols, block)));
  fp8::quantize_blocked(v, rows, cols, block, fp8::ScaleRule::Fp32, q.data(), s.data());
  fp8::dequantize_blocked(q.data(), s.data(), rows, cols, block, v);
}

void fp8_round(float* v, int64_t rows, int64_t cols, fp8::BlockShape block, Precision p = Precision::FP8) {
  if (p == Precision::MXFP8) block = fp8::kMxBlockShape;
  const int64_t block_rows = (rows + block.rows - 1) / block.rows;
  const int64_t threads = std::min<int64_t>(
      {block_rows, std::max<int64_t>(1, std::thread::hardware_concurrency()), rows * cols / (1 << 20) + 1});
  if (threads <= 1) return fp8_round_slab(v, rows, cols, block, p);
  const int64_t per = (block_rows + threads - 1) / threads * block.rows;  // rows per slab
  std::vector<std::thread> pool;
  for (int64_t r0 = 0; r0 < rows; r0 += per)
    pool.emplace_back(fp8_round_slab, v + r0 * cols, std::min(per, rows - r0), cols, block, p);
  for (auto& t : pool) t.join();
}
}  // namespace

void fp8_round_weights(int64_t H, int64_t I, float* w, Precision p) {
  if (p == Precision::BF16) return;
  fp8_round(w, I, H, fp8::kWeightBlock, p);              // gate [I, H]
  fp8_round(w + I * H, I, H, fp8::kWeightBlock, p);      // up [I, H]
  fp8_round(w + 2 * I * H, H, I, fp8::kWeightBlock, p);  // down [H, I]
}

TokenExpert token_through_expert(int64_t H, int64_t I, const float* w, const float* x, Precision p) {
  const float* wg = w;
  const float* wu = wg + I * H;
  const float* wd = wu + I * H;
  TokenExpert t{std::vector<float>(I), std::vector<float>(I), std::vector<float>(I), std::vector<float>(H)};
  for (int64_t i = 0; i < I; ++i) {
    float g = 0, u = 0;
    for (int64_t c = 0; c < H; ++c) {
      g += x[c] * wg[i * H + c];
      u += x[c] * wu[i * H + c];
    }
    t.g[i] = round_bf16(g);
    t.u[i] = round_bf16(u);
    t.h[i] = round_bf16(silu(t.g[i]) * t.u[i]);
  }
  if (p != Precision::BF16) fp8_round(t.h.data(), 1, I, fp8::kActivationBlock, p);  // FC2 reads h quantized
  for (int64_t c = 0; c < H; ++c) {
    float y = 0;
    for (int64_t i = 0; i < I; ++i) y += t.h[i] * wd[c * I + i];
    t.y[c] = round_bf16(y);
  }
  return t;
}

std::vector<float> token_forward(int64_t H, int64_t I, int64_t k, const float* x, const int32_t* topk_idx,
                                 const float* topk_w, const ExpertWeights& expert, Precision p) {
  std::vector<float> acc(static_cast<size_t>(H), 0.0f);
  std::vector<float> xq;
  if (p != Precision::BF16) {  // x quantized once at its source
    xq.assign(x, x + H);
    fp8_round(xq.data(), 1, H, fp8::kActivationBlock, p);
    x = xq.data();
  }
  for (int64_t j = 0; j < k; ++j) {
    if (topk_idx[j] < 0) continue;
    const TokenExpert t = token_through_expert(H, I, expert(topk_idx[j]), x, p);
    for (int64_t c = 0; c < H; ++c) acc[c] = std::fma(topk_w[j], t.y[c], acc[c]);
  }
  for (auto& v : acc) v = round_bf16(v);
  return acc;
}

std::vector<float> token_backward(int64_t H, int64_t I, int64_t k, const float* x, const float* d_out,
                                  const int32_t* topk_idx, const float* topk_w, const ExpertWeights& expert) {
  std::vector<float> dx(static_cast<size_t>(H), 0.0f), d_w(static_cast<size_t>(k), 0.0f);
  std::vector<float> dg(static_cast<size_t>(I)), du(static_cast<size_t>(I));
  for (int64_t j = 0; j < k; ++j) {
    if (topk_idx[j] < 0) continue;
    const float* w = expert(topk_idx[j]);
    const float* wg = w;
    const float* wu = wg + I * H;
    const float* wd = wu + I * H;
    const TokenExpert t = token_through_expert(H, I, w, x);
    // Loops ordered for contiguous weight rows; each sum still runs over its index in increasing order.
    std::vector<float> dh(static_cast<size_t>(I), 0.0f), a(static_cast<size_t>(H), 0.0f);
    for (int64_t c = 0; c < H; ++c)
      for (int64_t i = 0; i < I; ++i) dh[i] += d_out[c] * wd[c * I + i];
    for (int64_t i = 0; i < I; ++i) {
      const float gi = round_bf16(dh[i]);  // the unweighted d_h
      d_w[j] += gi * t.h[i];
      dh[i] = round_bf16(topk_w[j] * gi);
    }
    for (int64_t i = 0; i < I; ++i) {
      const float d = dh[i], g = t.g[i], s = sigmoid(g);
      du[i] = round_bf16(g * s * d);
      dg[i] = round_bf16(s * (1.0f + g * (1.0f - s)) * t.u[i] * d);
    }
    for (int64_t i = 0; i < I; ++i)
      for (int64_t c = 0; c < H; ++c) a[c] += dg[i] * wg[i * H + c];
    for (int64_t i = 0; i < I; ++i)
      for (int64_t c = 0; c < H; ++c) a[c] += du[i] * wu[i * H + c];
    for (int64_t c = 0; c < H; ++c) dx[c] += round_bf16(a[c]);
  }
  for (auto& v : dx) v = round_bf16(v);
  dx.insert(dx.end(), d_w.begin(), d_w.end());
  return dx;
}

}  // namespace mok::ref
