#include "reference/fp64_model.h"

#include <cmath>

namespace mok::ref {

namespace {
size_t sz(int64_t v) { return static_cast<size_t>(v); }

// FFN(v) = Wd (silu(Wg v) * (Wu v)), fp64.
void ffn(const double* wg, const double* wu, const double* wd, int64_t H, int64_t I,
         const double* v, double* y) {
  std::vector<double> h(sz(I));
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t c = 0; c < H; ++c) {
      g += wg[i * H + c] * v[c];
      u += wu[i * H + c] * v[c];
    }
    h[sz(i)] = g / (1.0 + std::exp(-g)) * u;
  }
  for (int64_t c = 0; c < H; ++c) {
    double s = 0;
    for (int64_t i = 0; i < I; ++i) s += wd[c * I + i] * h[sz(i)];
    y[c] = s;
  }
}
}  // namespace

std::vector<double> flat_f64(const std::vector<bf16>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = double(float(v[i]));
  return o;
}

std::vector<double> flat_f64(const std::vector<std::vector<bf16>>& v) {
  std::vector<double> o;
  for (const auto& r : v)
    for (bf16 x : r) o.push_back(double(float(x)));
  return o;
}

std::vector<double> flat_f64(const std::vector<std::vector<float>>& v) {
  std::vector<double> o;
  for (const auto& r : v) o.insert(o.end(), r.begin(), r.end());
  return o;
}

std::vector<double> flat_f64(const std::vector<std::vector<double>>& v) {
  std::vector<double> o;
  for (const auto& r : v) o.insert(o.end(), r.begin(), r.end());
  return o;
}

F64Params to_f64(const Workload& wl) {
  F64Params p;
  for (const auto& in : wl.inputs) {
    p.x.push_back(flat_f64(in.x));
    p.w.emplace_back(in.topk_w.begin(), in.topk_w.end());
  }
  p.wg = flat_f64(wl.weights.w_gate);
  p.wu = flat_f64(wl.weights.w_up);
  p.wd = flat_f64(wl.weights.w_down);
  p.sg = flat_f64(wl.weights.ws_gate);
  p.su = flat_f64(wl.weights.ws_up);
  p.sd = flat_f64(wl.weights.ws_down);
  return p;
}

std::vector<std::vector<double>> f64_forward(const LayerShape& shape, const Workload& wl,
                                             const F64Params& p) {
  const int64_t H = shape.hidden, I = shape.intermediate, E = shape.experts, k = shape.top_k,
                Is = shape.shared_intermediate;
  std::vector<std::vector<double>> out(sz(shape.world_size()));
  std::vector<double> y(sz(H));
  for (int r = 0; r < shape.world_size(); ++r) {
    const int64_t T = shape.tokens_of(r);
    out[sz(r)].assign(sz(T * H), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const double* v = &p.x[sz(r)][sz(t * H)];
      double* o = &out[sz(r)][sz(t * H)];
      if (Is > 0) {
        ffn(p.sg.data(), p.su.data(), p.sd.data(), H, Is, v, y.data());
        for (int64_t c = 0; c < H; ++c) o[c] += y[sz(c)];
      }
      for (int64_t e = 0; e < E; ++e) {  // dense: every expert, masked by the routing
        double gate = 0;
        for (int64_t j = 0; j < k; ++j)
          if (wl.inputs[sz(r)].topk_idx[sz(t * k + j)] == e) gate += p.w[sz(r)][sz(t * k + j)];
        bool routed = false;
        for (int64_t j = 0; j < k; ++j) routed |= wl.inputs[sz(r)].topk_idx[sz(t * k + j)] == e;
        if (!routed) continue;
        ffn(&p.wg[sz(e * I * H)], &p.wu[sz(e * I * H)], &p.wd[sz(e * H * I)], H, I, v, y.data());
        for (int64_t c = 0; c < H; ++c) o[c] += gate * y[sz(c)];
      }
    }
  }
  return out;
}

double f64_loss(const LayerShape& shape, const Workload& wl, const F64Params& p) {
  const auto out = f64_forward(shape, wl, p);
  double s = 0;
  for (int r = 0; r < shape.world_size(); ++r)
    for (size_t i = 0; i < out[sz(r)].size(); ++i) s += out[sz(r)][i] * double(float(wl.d_out[sz(r)][i]));
  return s;
}

double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

namespace {
// Accumulates the gradients of G * <d, FFN(v)> and returns <d, FFN(v)>.
double ffn_backward(const double* wg, const double* wu, const double* wd, int64_t H, int64_t I,
                    const double* v, const double* d, double G, double* dv, double* dwg,
                    double* dwu, double* dwd) {
  std::vector<double> a(sz(I)), b(sz(I)), s(sz(I)), h(sz(I)), dh(sz(I), 0.0);
  for (int64_t i = 0; i < I; ++i) {
    double ga = 0, gb = 0;
    for (int64_t c = 0; c < H; ++c) {
      ga += wg[i * H + c] * v[c];
      gb += wu[i * H + c] * v[c];
    }
    a[sz(i)] = ga;
    b[sz(i)] = gb;
    s[sz(i)] = 1.0 / (1.0 + std::exp(-ga));
    h[sz(i)] = ga * s[sz(i)] * gb;
  }
  double dot = 0;
  for (int64_t c = 0; c < H; ++c) {
    double y = 0;
    for (int64_t i = 0; i < I; ++i) y += wd[c * I + i] * h[sz(i)];
    dot += d[c] * y;
    const double dy = G * d[c];
    for (int64_t i = 0; i < I; ++i) {
      dh[sz(i)] += wd[c * I + i] * dy;
      dwd[c * I + i] += dy * h[sz(i)];
    }
  }
  for (int64_t i = 0; i < I; ++i) {
    const double da = dh[sz(i)] * b[sz(i)] * s[sz(i)] * (1.0 + a[sz(i)] * (1.0 - s[sz(i)]));
    const double db = dh[sz(i)] * a[sz(i)] * s[sz(i)];
    for (int64_t c = 0; c < H; ++c) {
      dv[c] += wg[i * H + c] * da + wu[i * H + c] * db;
      dwg[i * H + c] += da * v[c];
      dwu[i * H + c] += db * v[c];
    }
  }
  return dot;
}
}  // namespace

F64Grads f64_backward(const LayerShape& shape, const Workload& wl, const F64Params& p) {
  const int64_t H = shape.hidden, I = shape.intermediate, E = shape.experts, k = shape.top_k,
                Is = shape.shared_intermediate;
  const int W = shape.world_size();
  F64Grads g;
  g.d_wg.assign(sz(E * I * H), 0.0);
  g.d_wu.assign(sz(E * I * H), 0.0);
  g.d_wd.assign(sz(E * H * I), 0.0);
  std::vector<double> d(sz(H));
  for (int r = 0; r < W; ++r) {
    const int64_t T = shape.tokens_of(r);
    g.d_x.emplace_back(sz(T * H), 0.0);
    g.d_w.emplace_back(sz(T * k), 0.0);
    g.d_sg.emplace_back(sz(Is * H), 0.0);
    g.d_su.emplace_back(sz(Is * H), 0.0);
    g.d_sd.emplace_back(sz(H * Is), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < H; ++c) d[sz(c)] = double(float(wl.d_out[sz(r)][sz(t * H + c)]));
      const double* v = &p.x[sz(r)][sz(t * H)];
      double* dv = &g.d_x[sz(r)][sz(t * H)];
      if (Is > 0)
        ffn_backward(p.sg.data(), p.su.data(), p.sd.data(), H, Is, v, d.data(), 1.0, dv,
                     g.d_sg[sz(r)].data(), g.d_su[sz(r)].data(), g.d_sd[sz(r)].data());
      for (int64_t e = 0; e < E; ++e) {
        double G = 0;
        bool routed = false;
        for (int64_t j = 0; j < k; ++j) {
          if (wl.inputs[sz(r)].topk_idx[sz(t * k + j)] != e) continue;
          routed = true;
          G += p.w[sz(r)][sz(t * k + j)];
        }
        if (!routed) continue;
        const double dot = ffn_backward(&p.wg[sz(e * I * H)], &p.wu[sz(e * I * H)],
                                        &p.wd[sz(e * H * I)], H, I, v, d.data(), G, dv,
                                        &g.d_wg[sz(e * I * H)], &g.d_wu[sz(e * I * H)],
                                        &g.d_wd[sz(e * H * I)]);
        for (int64_t j = 0; j < k; ++j)
          if (wl.inputs[sz(r)].topk_idx[sz(t * k + j)] == e) g.d_w[sz(r)][sz(t * k + j)] = dot;
      }
    }
  }
  return g;
}

const TensorError* F64Comparison::worst_backward() const {
  const TensorError* worst = nullptr;
  for (const auto& e : backward)
    if (worst == nullptr || !(e.rel_err <= worst->rel_err)) worst = &e;  // NaN counts as worst
  return worst;
}

bool F64Comparison::within_tolerances() const {
  // Written as !(err < tol) so that a NaN error fails.
  if (!(forward_rel_err < kF64ForwardTol)) return false;
  for (const auto& e : backward)
    if (!(e.rel_err < kF64BackwardTol)) return false;
  return true;
}

F64Comparison compare_to_f64(const Workload& wl, const ForwardResult& fwd, const Gradients* grads) {
  const LayerShape& shape = wl.shape;
  const F64Params p = to_f64(wl);
  F64Comparison c;
  c.forward_rel_err = rel_error(flat_f64(fwd.out), flat_f64(f64_forward(shape, wl, p)));
  if (grads == nullptr) return c;
  const F64Grads r = f64_backward(shape, wl, p);
  const Gradients& g = *grads;
  c.backward = {{"d_x", rel_error(flat_f64(g.d_x), flat_f64(r.d_x))},
                {"d_topk_w", rel_error(flat_f64(g.d_topk_w), flat_f64(r.d_w))},
                {"d_w_gate", rel_error(flat_f64(g.d_w_gate), r.d_wg)},
                {"d_w_up", rel_error(flat_f64(g.d_w_up), r.d_wu)},
                {"d_w_down", rel_error(flat_f64(g.d_w_down), r.d_wd)}};
  if (shape.shared_intermediate > 0) {
    c.backward.push_back({"d_ws_gate", rel_error(flat_f64(g.d_ws_gate), flat_f64(r.d_sg))});
    c.backward.push_back({"d_ws_up", rel_error(flat_f64(g.d_ws_up), flat_f64(r.d_su))});
    c.backward.push_back({"d_ws_down", rel_error(flat_f64(g.d_ws_down), flat_f64(r.d_sd))});
  }
  return c;
}

}  // namespace mok::ref
