// CPU reference engine: W simulated ranks executing mok's layout (see include/mok/reference.hpp
// for the rounding points, which this file implements line by line).
#include <algorithm>
#include <numeric>
#include <span>

#include "mok/errors.hpp"
#include "mok/reference.hpp"
#include "mok/validate.hpp"
#include "reference/cpu_math.h"
#include "reference/fp8_quant.h"
#include "reference/merge_ref.h"
#include "schedule/schedule_math.h"

namespace mok::ref {

namespace {

using sched::chunk_begin;
using sched::chunk_end;
using sched::num_chunks;

size_t sz(int64_t v) { return static_cast<size_t>(v); }

// Config::precision FP8 (recipe 1, include/mok/reference.hpp): values replaced by what their
// block-scaled E4M3 codes decode to — rows per 1 x 128 (activations), matrices per 128 x 128
// (weights) — with fp32 scales (amax / 448). MXFP8 (recipe 2): E4M3 with an E8M0 scale per 32
// consecutive values along K, for activation rows and weight rows alike.
void mx_round_rows(float* v, int64_t rows, int64_t cols) {
  std::vector<uint8_t> q(sz(rows * cols)), s(sz(fp8::scale_count(rows, cols, fp8::kMxBlockShape)));
  fp8::quantize_mxfp8(v, rows, cols, q.data(), s.data());
  fp8::dequantize_mxfp8(q.data(), s.data(), rows, cols, v);
}
// MX blocks down the columns: 32 consecutive rows of a column per E8M0 scale.
void mx_round_cols(std::vector<float>& v, int64_t rows, int64_t cols) {
  auto t = transpose(v.data(), rows, cols);  // [cols, rows]
  mx_round_rows(t.data(), cols, rows);
  v = transpose(t.data(), cols, rows);
}
void fp8_round_rows(float* v, int64_t rows, int64_t cols, Precision p) {
  if (p == Precision::MXFP8) return mx_round_rows(v, rows, cols);
  std::vector<uint8_t> q(sz(rows * cols));
  std::vector<float> s(sz(fp8::scale_count(rows, cols, fp8::kActivationBlock)));
  fp8::quantize_1x128(v, rows, cols, q.data(), s.data());
  fp8::dequantize_blocked(q.data(), s.data(), rows, cols, fp8::kActivationBlock, v);
}
// A weight matrix [rows, cols] with K = cols (every weight the FFN holds is stored K-contiguous:
// gate and up [I, H], down [H, I]).
void fp8_round_matrix(std::vector<float>& v, int64_t rows, int64_t cols, Precision p) {
  if (p == Precision::MXFP8) return mx_round_rows(v.data(), rows, cols);
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(sz(fp8::scale_count(rows, cols, fp8::kWeightBlock)));
  fp8::quantize_128x128(v.data(), rows, cols, q.data(), s.data());
  fp8::dequantize_blocked(q.data(), s.data(), rows, cols, fp8::kWeightBlock, v.data());
}

// The FP8 backward's blocks (recipe 1, notes/fp8.md): a wgrad operand [rows, cols] whose K is its
// rows (tokens) is quantized per 128 x 1 block — 128 consecutive rows of a column, which are one
// 128-row M tile of the expert's segment (segments start at tile boundaries and every ring window
// is a whole number of tiles, so the blocks are the same in every memory mode).
// MXFP8 (recipe 2): 32 x 1 MX blocks along the tokens (32 | 128, so none straddles a tile).
void fp8_round_token_blocks(std::vector<float>& v, int64_t rows, int64_t cols, Precision p = Precision::FP8) {
  if (p == Precision::MXFP8) return mx_round_cols(v, rows, cols);  // 32 consecutive tokens of a column
  constexpr fp8::BlockShape kTokens{fp8::kBlock, 1};
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(sz(fp8::scale_count(rows, cols, kTokens)));
  fp8::quantize_blocked(v.data(), rows, cols, kTokens, fp8::ScaleRule::Fp32, q.data(), s.data());
  fp8::dequantize_blocked(q.data(), s.data(), rows, cols, kTokens, v.data());
}
// FC1's dgrad reads [d_g d_u] with K = 2I in the packed order of the GPU's gate/up weights, so a
// 1 x 128 block there is the gate and the up values of the same 64 intermediate columns: row r's
// block j = {dg[r, 64j .. 64j+63], du[r, 64j .. 64j+63]} (dgu holds dg then du per row).
void fp8_round_gate_up_rows(std::vector<float>& dgu, int64_t rows, int64_t I) {
  std::vector<float> blk(fp8::kBlock);
  std::vector<uint8_t> q(fp8::kBlock);
  for (int64_t r = 0; r < rows; ++r) {
    float* g = &dgu[sz(r * 2 * I)];
    float* u = g + I;
    for (int64_t i0 = 0; i0 < I; i0 += fp8::kBlock / 2) {
      const int64_t n = std::min<int64_t>(fp8::kBlock / 2, I - i0);
      std::copy_n(g + i0, n, blk.data());
      std::copy_n(u + i0, n, blk.data() + n);
      const float sc = fp8::quantize_block(blk.data(), 2 * n, fp8::ScaleRule::Fp32, q.data());
      for (int64_t i = 0; i < n; ++i) {
        g[i0 + i] = fp8::e4m3_decode(q[sz(i)]) * sc;
        u[i0 + i] = fp8::e4m3_decode(q[sz(n + i)]) * sc;
      }
    }
  }
}

// FC1's dgrad reads [W_gate; W_up] with K = 2I in the same packed order as [d_g d_u] (above), so
// in FP8 its 128 x 128 blocks are the gate and the up rows of the same 64 intermediate columns by
// 128 hidden columns: block (j, c) = {W_gate[64j .. 64j+63], W_up[64j .. 64j+63]} x [128c ..
// 128c+127], quantized together (one fp32 scale) from the bf16 weights — what the GPU's K-major
// copy of the packed weights gets (gemm::transpose_weights_bf16 then 128 x 128 blocks). Returns
// the decoded values [2I, H]: gate rows, then up rows.
std::vector<float> fp8_gate_up_dgrad_weights(const bf16* wg, const bf16* wu, int64_t I, int64_t H) {
  std::vector<float> out(sz(2 * I * H));
  const int64_t half = fp8::kBlock / 2;
  std::vector<float> blk;
  std::vector<uint8_t> q;
  for (int64_t i0 = 0; i0 < I; i0 += half)
    for (int64_t c0 = 0; c0 < H; c0 += fp8::kBlock) {
      const int64_t ni = std::min(half, I - i0), nc = std::min<int64_t>(fp8::kBlock, H - c0);
      blk.clear();
      for (const bf16* w : {wg, wu})
        for (int64_t i = i0; i < i0 + ni; ++i)
          for (int64_t c = c0; c < c0 + nc; ++c) blk.push_back(static_cast<float>(w[sz(i * H + c)]));
      q.resize(blk.size());
      const float sc = fp8::quantize_block(blk.data(), static_cast<int64_t>(blk.size()), fp8::ScaleRule::Fp32, q.data());
      size_t at = 0;
      for (int64_t part = 0; part < 2; ++part)
        for (int64_t i = i0; i < i0 + ni; ++i)
          for (int64_t c = c0; c < c0 + nc; ++c) out[sz((part * I + i) * H + c)] = fp8::e4m3_decode(q[at++]) * sc;
    }
  return out;
}

// One expert's FFN weights in fp32, in the [K, N] layouts the GEMMs stream.
struct ExpertF {
  int64_t H = 0, I = 0;
  std::vector<float> gate_t, up_t;  // [H, I]  FC1 forward
  std::vector<float> down_t;        // [I, H]  FC2 forward
  std::vector<float> down;          // [H, I]  FC2 dgrad
  std::vector<float> gate_up;       // [2I, H] FC1 dgrad: gate rows, then up rows

  // Config::precision FP8 / MXFP8: weights and activations as their codes decode (BF16: as given).
  Precision precision = Precision::BF16;
  ExpertF(const bf16* wg, const bf16* wu, const bf16* wd, int64_t H_, int64_t I_, Precision p = Precision::BF16)
      : H(H_), I(I_), precision(p) {
    auto g = to_float(wg, I * H), u = to_float(wu, I * H);
    down = to_float(wd, H * I);
    if (p != Precision::BF16) {  // each weight matrix in the layout the caller holds it (K contiguous)
      fp8_round_matrix(g, I, H, p);
      fp8_round_matrix(u, I, H, p);
      fp8_round_matrix(down, H, I, p);
    }
    gate_t = transpose(g.data(), I, H);
    up_t = transpose(u.data(), I, H);
    down_t = transpose(down.data(), H, I);
    if (p == Precision::FP8) {  // FC1's dgrad: its own blocks (fp8_gate_up_dgrad_weights)
      gate_up = fp8_gate_up_dgrad_weights(wg, wu, I, H);
    } else if (p == Precision::MXFP8) {
      // MX blocks run along each GEMM's K, so the dgrads read the weights blocked along the other
      // axis than the forward: W_down along H (FC2's dgrad), W_gate and W_up along I (FC1's; its
      // packed K order's 32-blocks are all gate or all up) — each from the bf16 weights.
      const auto along_cols = [](const bf16* w, int64_t rows, int64_t cols) {
        auto v = to_float(w, rows * cols);
        mx_round_cols(v, rows, cols);
        return v;
      };
      down = along_cols(wd, H, I);
      gate_up = along_cols(wg, I, H);
      const auto up_d = along_cols(wu, I, H);
      gate_up.insert(gate_up.end(), up_d.begin(), up_d.end());
    } else {
      gate_up = std::move(g);
      gate_up.insert(gate_up.end(), u.begin(), u.end());
    }
  }
};

// Activations of M rows through one FFN (forward), all at their rounding points. h is the bf16
// rnd(silu(g) u); FP8 / MXFP8: FC2 reads it quantized, the backward (hw, the router-weight
// gradient) reads it as is.
struct FfnActs {
  std::vector<float> g, u, h, y;  // [M, I] x3, [M, H]
};

FfnActs ffn_forward(const ExpertF& e, const float* v, int64_t M, int threads) {
  FfnActs a;
  const int64_t H = e.H, I = e.I;
  a.g.resize(sz(M * I));
  a.u.resize(sz(M * I));
  a.h.resize(sz(M * I));
  a.y.resize(sz(M * H));
  matmul(v, e.gate_t.data(), a.g.data(), M, H, I, threads);
  matmul(v, e.up_t.data(), a.u.data(), M, H, I, threads);
  round_in_place(a.g.data(), M * I);
  round_in_place(a.u.data(), M * I);
  for (int64_t i = 0; i < M * I; ++i) a.h[sz(i)] = round_bf16(silu(a.g[sz(i)]) * a.u[sz(i)]);
  const float* h_in = a.h.data();
  std::vector<float> hq;  // FP8 / MXFP8: FC2 reads h quantized
  if (e.precision != Precision::BF16) {
    hq = a.h;
    fp8_round_rows(hq.data(), M, I, e.precision);
    h_in = hq.data();
  }
  matmul(h_in, e.down_t.data(), a.y.data(), M, I, H, threads);
  round_in_place(a.y.data(), M * H);
  return a;
}

// Backward of M rows through one FFN given their unweighted d_out rows `d` and router weights
// `w` (nullptr: weight 1, the shared expert): g = rnd(d . Wd), dh = rnd(w * g).
struct FfnGrads {
  std::vector<float> g, dg, du, dx;  // [M, I] x3, [M, H]
};

FfnGrads ffn_backward(const ExpertF& e, const FfnActs& a, const float* d_rows, const float* w, int64_t M,
                      int threads) {
  FfnGrads d;
  const int64_t H = e.H, I = e.I;
  const bool fp8 = e.precision != Precision::BF16;
  d.g.resize(sz(M * I));
  std::vector<float> dq;  // FP8 / MXFP8: the d_out rows as FC2's dgrad reads them (1 x 128 / 1 x 32 along H)
  if (fp8) {
    dq.assign(d_rows, d_rows + M * H);
    fp8_round_rows(dq.data(), M, H, e.precision);
    d_rows = dq.data();
  }
  matmul(d_rows, e.down.data(), d.g.data(), M, H, I, threads);
  round_in_place(d.g.data(), M * I);
  std::vector<float> dh = d.g;
  if (w != nullptr)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t i = 0; i < I; ++i) dh[sz(r * I + i)] = round_bf16(w[r] * dh[sz(r * I + i)]);
  d.dg.resize(sz(M * I));
  d.du.resize(sz(M * I));
  std::vector<float> dgu(sz(M * 2 * I));  // [M, 2I]: dg then du per row, matching gate_up
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      const size_t x = sz(r * I + i);
      const float g = a.g[x], s = sigmoid(g);
      d.du[x] = round_bf16(g * s * dh[x]);
      d.dg[x] = round_bf16(s * (1.0f + g * (1.0f - s)) * a.u[x] * dh[x]);
      dgu[sz(r * 2 * I + i)] = d.dg[x];
      dgu[sz(r * 2 * I + I + i)] = d.du[x];
    }
  }
  d.dx.resize(sz(M * H));
  // FC1's dgrad reads [d_g d_u] quantized (d.dg, d.du stay bf16); MX: 1 x 32 along the row, whose
  // blocks are all gate or all up (I a multiple of 32), as in the packed order.
  if (e.precision == Precision::FP8) fp8_round_gate_up_rows(dgu, M, I);
  if (e.precision == Precision::MXFP8) mx_round_rows(dgu.data(), M, 2 * I);
  matmul(dgu.data(), e.gate_up.data(), d.dx.data(), M, 2 * I, H, threads);
  round_in_place(d.dx.data(), M * H);
  return d;
}

// dW[N_out, K_out] = rnd(sum_rows A[rows, N_out]^T B[rows, K_out]) with rows in the given order.
void weight_grad(const std::vector<float>& A, const std::vector<float>& B, int64_t rows,
                 int64_t n_out, int64_t k_out, bf16* out, int threads) {
  auto at = transpose(A.data(), rows, n_out);  // [n_out, rows]
  std::vector<float> c(sz(n_out * k_out));
  matmul(at.data(), B.data(), c.data(), n_out, rows, k_out, threads);
  for (int64_t i = 0; i < n_out * k_out; ++i) out[i] = bf16(c[sz(i)]);
}

// Calls fn(local_expert, first_row, rows, weights) for the valid rows of each of rank d's
// expert segments that fall inside the ring window [b, e) (padding rows would give zeros).
template <typename Fn>
void for_each_segment(const ScheduleTable& s, int d, int64_t b, int64_t e, const LayerWeights& w,
                      int64_t H, int64_t I, Fn&& fn, Precision precision = Precision::BF16) {
  for (int64_t le = 0; le < s.local_experts; ++le) {
    const int64_t seg_b = std::max(b, int64_t{s.expert_offset[sz(le)]});
    const int64_t seg_e = std::min(e, int64_t{s.expert_offset[sz(le)]} + s.expert_rows[sz(le)]);
    if (seg_b >= seg_e) continue;
    const int64_t ge = d * s.local_experts + le;
    const ExpertF ex(&w.w_gate[sz(ge * I * H)], &w.w_up[sz(ge * I * H)], &w.w_down[sz(ge * H * I)], H, I, precision);
    fn(le, seg_b, seg_e - seg_b, ex);
  }
}

std::vector<std::span<const int32_t>> routing_spans(const std::vector<RankInput>& in) {
  std::vector<std::span<const int32_t>> s;
  for (const auto& r : in) s.emplace_back(r.topk_idx);
  return s;
}

}  // namespace

Engine::Engine(LayerShape shape, Config config) : shape_(std::move(shape)), config_(config) {
  config_.validate(shape_);
}

void Engine::validate_inputs(const std::vector<RankInput>& in, const LayerWeights& w) const {
  const int W = shape_.world_size();
  MOK_REQUIRE(static_cast<int>(in.size()) == W, "inputs", "one RankInput per rank is required (W = ",
              W, "), got ", in.size());
  for (int r = 0; r < W; ++r) {
    const int64_t T = shape_.tokens_of(r);
    RoutingRefs refs{TensorRef::contiguous(in[sz(r)].x.data(), DType::BF16, {static_cast<int64_t>(in[sz(r)].x.size() / std::max<int64_t>(1, shape_.hidden)), shape_.hidden}),
                     TensorRef::contiguous(in[sz(r)].topk_idx.data(), DType::I32, {static_cast<int64_t>(in[sz(r)].topk_idx.size() / shape_.top_k), shape_.top_k}),
                     TensorRef::contiguous(in[sz(r)].topk_w.data(), DType::F32, {static_cast<int64_t>(in[sz(r)].topk_w.size() / shape_.top_k), shape_.top_k})};
    MOK_REQUIRE(static_cast<int64_t>(in[sz(r)].x.size()) == T * shape_.hidden, "x",
                "rank ", r, " must hold T*H = ", T * shape_.hidden, " values, got ", in[sz(r)].x.size());
    MOK_REQUIRE(static_cast<int64_t>(in[sz(r)].topk_idx.size()) == T * shape_.top_k, "topk_idx",
                "rank ", r, " must hold T*k = ", T * shape_.top_k, " values, got ", in[sz(r)].topk_idx.size());
    MOK_REQUIRE(static_cast<int64_t>(in[sz(r)].topk_w.size()) == T * shape_.top_k, "topk_w",
                "rank ", r, " must hold T*k = ", T * shape_.top_k, " values, got ", in[sz(r)].topk_w.size());
    validate_routing_values(shape_, r, refs);
  }
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate,
                Is = shape_.shared_intermediate;
  MOK_REQUIRE(static_cast<int64_t>(w.w_gate.size()) == E * I * H, "w_gate", "must hold E*I*H = ", E * I * H, " values, got ", w.w_gate.size());
  MOK_REQUIRE(static_cast<int64_t>(w.w_up.size()) == E * I * H, "w_up", "must hold E*I*H = ", E * I * H, " values, got ", w.w_up.size());
  MOK_REQUIRE(static_cast<int64_t>(w.w_down.size()) == E * H * I, "w_down", "must hold E*H*I = ", E * H * I, " values, got ", w.w_down.size());
  MOK_REQUIRE(static_cast<int64_t>(w.ws_gate.size()) == Is * H, "ws_gate", "must hold Is*H = ", Is * H, " values, got ", w.ws_gate.size());
  MOK_REQUIRE(static_cast<int64_t>(w.ws_up.size()) == Is * H, "ws_up", "must hold Is*H = ", Is * H, " values, got ", w.ws_up.size());
  MOK_REQUIRE(static_cast<int64_t>(w.ws_down.size()) == H * Is, "ws_down", "must hold H*Is = ", H * Is, " values, got ", w.ws_down.size());
}

ForwardResult Engine::forward(const std::vector<RankInput>& in, const LayerWeights& w) const {
  validate_inputs(in, w);
  const int W = shape_.world_size(), threads = config_.cpu_threads;
  const int64_t H = shape_.hidden, I = shape_.intermediate, k = shape_.top_k,
                Is = shape_.shared_intermediate;
  const int64_t ring_rows = config_.resolved_macrobatch(shape_);
  const auto spans = routing_spans(in);
  const Precision precision = config_.precision;
  const bool fp8 = precision != Precision::BF16;

  // Combine buffers: one [T*k, H] per source rank, written only by pushes.
  std::vector<std::vector<float>> combine(sz(W));
  for (int r = 0; r < W; ++r) combine[sz(r)].assign(sz(shape_.tokens_of(r) * k * H), 0.0f);

  ForwardResult res;
  std::vector<float> ring(sz(ring_rows * H));
  for (int d = 0; d < W; ++d) {  // every destination rank runs its own "kernel"
    ScheduleTable s = build_schedule_cpu(shape_, d, spans);
    const int64_t n_macro = num_chunks(s.total_rows, ring_rows);
    // Macrobatches last to first, so macrobatch 0 is resident at the end (kept for backward).
    for (int64_t m = n_macro - 1; m >= 0; --m) {
      const int64_t b = chunk_begin(m, ring_rows), e = chunk_end(m, ring_rows, s.total_rows);
      // Pull dispatch: ring row (row - b) <- x[src][slot / k]; padding rows are zero.
      for (int64_t row = b; row < e; ++row) {
        float* dst = &ring[sz((row - b) * H)];
        const int32_t src = s.src_rank[sz(row)];
        if (src < 0) {
          std::fill(dst, dst + H, 0.0f);
          continue;
        }
        const bf16* x = &in[sz(src)].x[sz(s.src_slot[sz(row)] / k * H)];
        for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(x[h]);
        if (fp8) fp8_round_rows(dst, 1, H, precision);  // x quantized once at its source: the row as its codes decode
      }
      // Experts on their segments.
      for_each_segment(s, d, b, e, w, H, I, [&](int64_t, int64_t seg_b, int64_t M, const ExpertF& ex) {
        FfnActs a = ffn_forward(ex, &ring[sz((seg_b - b) * H)], M, threads);
        // Push combine: unweighted y row -> combine[src][slot].
        for (int64_t r = 0; r < M; ++r) {
          const int64_t row = seg_b + r;
          std::copy_n(&a.y[sz(r * H)], H,
                      &combine[sz(s.src_rank[sz(row)])][sz(int64_t{s.src_slot[sz(row)]} * H)]);
        }
      }, precision);
    }
    res.macrobatches.push_back(n_macro);
    res.schedules.push_back(std::move(s));
  }

  // Merge at the source: out = rnd(y_s + sum_j fma(w_j, y_j)), fixed j order.
  std::unique_ptr<ExpertF> shared;
  if (Is > 0) shared = std::make_unique<ExpertF>(w.ws_gate.data(), w.ws_up.data(), w.ws_down.data(), H, Is, precision);
  res.out.resize(sz(W));
  for (int r = 0; r < W; ++r) {
    const int64_t T = shape_.tokens_of(r);
    std::vector<float> ys;
    if (shared) {
      auto xf = to_float(in[sz(r)].x.data(), T * H);
      if (fp8) fp8_round_rows(xf.data(), T, H, precision);
      ys = ffn_forward(*shared, xf.data(), T, threads).y;
    }
    res.out[sz(r)] = merge_rows(shared ? ys.data() : nullptr, combine[sz(r)].data(),
                                in[sz(r)].topk_w.data(), in[sz(r)].topk_idx.data(), T, k, H,
                                threads);
  }
  return res;
}

Gradients Engine::backward(const std::vector<RankInput>& in, const LayerWeights& w,
                           const std::vector<std::vector<bf16>>& d_out) const {
  validate_inputs(in, w);
  const int W = shape_.world_size(), threads = config_.cpu_threads;
  const int64_t H = shape_.hidden, I = shape_.intermediate, k = shape_.top_k,
                e_loc = shape_.local_experts(), Is = shape_.shared_intermediate, E = shape_.experts;
  const Precision precision = config_.precision;
  const bool fp8 = precision != Precision::BF16;  // FP8 (recipe 1) or MXFP8 (recipe 2)
  MOK_REQUIRE(static_cast<int>(d_out.size()) == W, "d_out", "one gradient per rank is required (W = ", W, "), got ", d_out.size());
  for (int r = 0; r < W; ++r)
    MOK_REQUIRE(static_cast<int64_t>(d_out[sz(r)].size()) == shape_.tokens_of(r) * H, "d_out",
                "rank ", r, " must hold T*H = ", shape_.tokens_of(r) * H, " values, got ", d_out[sz(r)].size());
  const int64_t ring_rows = config_.resolved_macrobatch(shape_);
  const auto spans = routing_spans(in);

  Gradients g;
  g.d_w_gate.resize(sz(E * I * H));
  g.d_w_up.resize(sz(E * I * H));
  g.d_w_down.resize(sz(E * H * I));
  std::vector<std::vector<float>> dx_slots(sz(W));  // reverse-dispatch targets [T*k, H]
  g.d_topk_w.resize(sz(W));
  for (int r = 0; r < W; ++r) {
    dx_slots[sz(r)].assign(sz(shape_.tokens_of(r) * k * H), 0.0f);
    g.d_topk_w[sz(r)].assign(sz(shape_.tokens_of(r) * k), 0.0f);
  }

  for (int d = 0; d < W; ++d) {
    const ScheduleTable s = build_schedule_cpu(shape_, d, spans);
    // Per local expert: rows kept for the weight gradients, keyed by (src rank, slot).
    struct Row { int64_t key; std::vector<float> v, dy, h, dg, du; };
    std::vector<std::vector<Row>> kept(sz(e_loc));
    std::vector<float> ring_x(sz(ring_rows * H)), ring_d(sz(ring_rows * H)), ring_w(sz(ring_rows));
    const int64_t n_macro = num_chunks(s.total_rows, ring_rows);
    for (int64_t m = n_macro - 1; m >= 0; --m) {
      const int64_t b = chunk_begin(m, ring_rows), e = chunk_end(m, ring_rows, s.total_rows);
      // Pull x (replay of dispatch) and the d_out rows with their router weights (reverse-combine).
      for (int64_t row = b; row < e; ++row) {
        float* xd = &ring_x[sz((row - b) * H)];
        float* dd = &ring_d[sz((row - b) * H)];
        const int32_t src = s.src_rank[sz(row)];
        if (src < 0) {
          std::fill(xd, xd + H, 0.0f);
          std::fill(dd, dd + H, 0.0f);
          ring_w[sz(row - b)] = 0.0f;
          continue;
        }
        const int64_t slot = s.src_slot[sz(row)], t = slot / k;
        ring_w[sz(row - b)] = in[sz(src)].topk_w[sz(slot)];
        for (int64_t h = 0; h < H; ++h) {
          xd[h] = static_cast<float>(in[sz(src)].x[sz(t * H + h)]);
          dd[h] = static_cast<float>(d_out[sz(src)][sz(t * H + h)]);
        }
      }
      // FP8: the forward's replay reads x as the forward did (1 x 128 codes); the weight gradients
      // read the bf16 rows (quantized per 128 x 1 below).
      std::vector<float> ring_xq;
      if (fp8) {
        ring_xq.assign(ring_x.begin(), ring_x.begin() + (e - b) * H);
        fp8_round_rows(ring_xq.data(), e - b, H, precision);
      }
      for_each_segment(s, d, b, e, w, H, I, [&](int64_t le, int64_t seg_b, int64_t M, const ExpertF& ex) {
        const float* xv = &ring_x[sz((seg_b - b) * H)];
        const float* dv = &ring_d[sz((seg_b - b) * H)];
        const float* wv = &ring_w[sz(seg_b - b)];
        FfnActs a = ffn_forward(ex, fp8 ? &ring_xq[sz((seg_b - b) * H)] : xv, M, threads);
        FfnGrads gr = ffn_backward(ex, a, dv, wv, M, threads);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t row = seg_b + r;
          const int32_t src = s.src_rank[sz(row)];
          const int64_t slot = s.src_slot[sz(row)];
          // Push reverse-dispatch and the router-weight gradient <g, h> to the source slot.
          std::copy_n(&gr.dx[sz(r * H)], H, &dx_slots[sz(src)][sz(slot * H)]);
          float dw = 0.0f;
          for (int64_t i = 0; i < I; ++i) dw += gr.g[sz(r * I + i)] * a.h[sz(r * I + i)];
          g.d_topk_w[sz(src)][sz(slot)] = dw;
          auto span_of = [&](const std::vector<float>& v, int64_t n) {
            return std::vector<float>(v.begin() + r * n, v.begin() + (r + 1) * n);
          };
          // dW_down's operands: the unweighted d_out row and the weighted h row rnd(w * h).
          std::vector<float> hw = span_of(a.h, I);
          for (float& v : hw) v = round_bf16(wv[r] * v);
          kept[sz(le)].push_back(Row{int64_t{src} * (int64_t{1} << 40) + slot,
                                     std::vector<float>(xv + r * H, xv + (r + 1) * H),
                                     std::vector<float>(dv + r * H, dv + (r + 1) * H), std::move(hw),
                                     span_of(gr.dg, I), span_of(gr.du, I)});
        }
      }, precision);
    }
    // Weight gradients of this rank's experts, rows in global token order.
    for (int64_t le = 0; le < e_loc; ++le) {
      auto& rows = kept[sz(le)];
      std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.key < b.key; });
      const int64_t M = static_cast<int64_t>(rows.size()), ge = d * e_loc + le;
      std::vector<float> V, DY, Hh, DG, DU;
      for (const auto& r : rows) {
        V.insert(V.end(), r.v.begin(), r.v.end());
        DY.insert(DY.end(), r.dy.begin(), r.dy.end());
        Hh.insert(Hh.end(), r.h.begin(), r.h.end());
        DG.insert(DG.end(), r.dg.begin(), r.dg.end());
        DU.insert(DU.end(), r.du.begin(), r.du.end());
      }
      if (fp8) {  // K = the expert's rows: 128 x 1 blocks, one per M tile and column
        fp8_round_token_blocks(DY, M, H, precision);
        fp8_round_token_blocks(Hh, M, I, precision);
        fp8_round_token_blocks(DG, M, I, precision);
        fp8_round_token_blocks(DU, M, I, precision);
        fp8_round_token_blocks(V, M, H, precision);
      }
      weight_grad(DY, Hh, M, H, I, &g.d_w_down[sz(ge * H * I)], threads);
      weight_grad(DG, V, M, I, H, &g.d_w_gate[sz(ge * I * H)], threads);
      weight_grad(DU, V, M, I, H, &g.d_w_up[sz(ge * I * H)], threads);
    }
  }

  // Shared expert (local to each rank) and the d_x merge at the source.
  std::unique_ptr<ExpertF> shared;
  if (Is > 0) shared = std::make_unique<ExpertF>(w.ws_gate.data(), w.ws_up.data(), w.ws_down.data(), H, Is, precision);
  g.d_x.resize(sz(W));
  g.d_ws_gate.resize(sz(W));
  g.d_ws_up.resize(sz(W));
  g.d_ws_down.resize(sz(W));
  for (int r = 0; r < W; ++r) {
    const int64_t T = shape_.tokens_of(r);
    std::vector<float> dxs;
    if (shared) {
      auto xf = to_float(in[sz(r)].x.data(), T * H);
      auto dof = to_float(d_out[sz(r)].data(), T * H);
      std::vector<float> xq;
      if (fp8) {  // as the forward read x
        xq = xf;
        fp8_round_rows(xq.data(), T, H, precision);
      }
      FfnActs a = ffn_forward(*shared, fp8 ? xq.data() : xf.data(), T, threads);
      FfnGrads gr = ffn_backward(*shared, a, dof.data(), nullptr, T, threads);
      dxs = std::move(gr.dx);
      if (fp8) {  // the weight gradients' operands per 128 x 1 block, tokens in order
        fp8_round_token_blocks(dof, T, H, precision);
        fp8_round_token_blocks(a.h, T, Is, precision);
        fp8_round_token_blocks(gr.dg, T, Is, precision);
        fp8_round_token_blocks(gr.du, T, Is, precision);
        fp8_round_token_blocks(xf, T, H, precision);
      }
      g.d_ws_down[sz(r)].resize(sz(H * Is));
      g.d_ws_gate[sz(r)].resize(sz(Is * H));
      g.d_ws_up[sz(r)].resize(sz(Is * H));
      weight_grad(dof, a.h, T, H, Is, g.d_ws_down[sz(r)].data(), threads);
      weight_grad(gr.dg, xf, T, Is, H, g.d_ws_gate[sz(r)].data(), threads);
      weight_grad(gr.du, xf, T, Is, H, g.d_ws_up[sz(r)].data(), threads);
    }
    g.d_x[sz(r)] = merge_rows(shared ? dxs.data() : nullptr, dx_slots[sz(r)].data(), nullptr,
                              in[sz(r)].topk_idx.data(), T, k, H, threads);
  }
  return g;
}

}  // namespace mok::ref
