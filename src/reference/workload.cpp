#include "mok/workload.hpp"

#include <algorithm>
#include <cmath>

#include "mok/errors.hpp"

namespace mok {

const char* to_string(Routing r) {
  switch (r) {
    case Routing::Uniform: return "uniform";
    case Routing::Zipf: return "zipf";
    case Routing::OneExpert: return "one-expert";
    case Routing::OneRank: return "one-rank";
    case Routing::EmptySlots: return "empty-slots";
  }
  return "?";
}

Routing routing_from_string(const std::string& s) {
  for (Routing r : {Routing::Uniform, Routing::Zipf, Routing::OneExpert, Routing::OneRank, Routing::EmptySlots})
    if (s == to_string(r)) return r;
  throw Error(ErrorKind::InvalidArgument, "routing",
              "must be one of uniform, zipf, one-expert, one-rank, empty-slots", "got '" + s + "'");
}

namespace {

size_t sz(int64_t v) { return static_cast<size_t>(v); }

void fill_normal(std::vector<bf16>& v, int64_t n, double scale, Rng& rng) {
  v.resize(sz(n));
  for (auto& x : v) x = bf16(static_cast<float>(rng.normal() * scale));
}

// k distinct experts drawn from `pool` with the given (unnormalized) weights, sequentially
// without replacement.
void draw_distinct(std::vector<int64_t> pool, std::vector<double> weight, int64_t k, Rng& rng,
                   int32_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    double total = 0;
    for (double w : weight) total += w;
    double u = rng.uniform() * total;
    size_t pick = pool.size() - 1;
    for (size_t i = 0; i < pool.size(); ++i) {
      if (u < weight[i]) { pick = i; break; }
      u -= weight[i];
    }
    out[j] = static_cast<int32_t>(pool[pick]);
    pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(pick));
    weight.erase(weight.begin() + static_cast<std::ptrdiff_t>(pick));
  }
}

}  // namespace

Workload make_workload(const LayerShape& shape, Routing routing, uint64_t seed, unsigned parts) {
  shape.validate();
  Workload wl;
  wl.shape = shape;
  Rng rng(seed);
  const int W = shape.world_size();
  const int64_t H = shape.hidden, I = shape.intermediate, E = shape.experts, k = shape.top_k,
                Is = shape.shared_intermediate, e_loc = shape.local_experts();

  // Weights ~ N(0, 1/fan_in) keep activations O(1) through both GEMMs.
  if (parts & kWeights) {
    fill_normal(wl.weights.w_gate, E * I * H, 1.0 / std::sqrt(double(H)), rng);
    fill_normal(wl.weights.w_up, E * I * H, 1.0 / std::sqrt(double(H)), rng);
    fill_normal(wl.weights.w_down, E * H * I, 1.0 / std::sqrt(double(I)), rng);
    fill_normal(wl.weights.ws_gate, Is * H, 1.0 / std::sqrt(double(H)), rng);
    fill_normal(wl.weights.ws_up, Is * H, 1.0 / std::sqrt(double(H)), rng);
    fill_normal(wl.weights.ws_down, H * Is, 1.0 / std::sqrt(double(std::max<int64_t>(Is, 1))), rng);
  }

  std::vector<int64_t> all(sz(E));
  for (int64_t e = 0; e < E; ++e) all[sz(e)] = e;
  std::vector<double> flat(sz(E), 1.0), zipf(sz(E));
  for (int64_t e = 0; e < E; ++e) zipf[sz(e)] = 1.0 / std::pow(double(e + 1), 1.2);

  wl.inputs.resize(sz(W));
  wl.d_out.resize(sz(W));
  for (int r = 0; r < W; ++r) {
    const int64_t T = shape.tokens_of(r);
    auto& in = wl.inputs[sz(r)];
    fill_normal(in.x, T * H, 1.0, rng);
    if (parts & kGradOutput) fill_normal(wl.d_out[sz(r)], T * H, 1.0, rng);
    in.topk_idx.assign(sz(T * k), -1);
    in.topk_w.assign(sz(T * k), 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      int32_t* idx = &in.topk_idx[sz(t * k)];
      switch (routing) {
        case Routing::Uniform:
        case Routing::EmptySlots: draw_distinct(all, flat, k, rng, idx); break;
        case Routing::Zipf: draw_distinct(all, zipf, k, rng, idx); break;
        case Routing::OneExpert: {
          std::vector<int64_t> rest(all.begin() + 1, all.end());
          draw_distinct(rest, std::vector<double>(rest.size(), 1.0), k - 1, rng, idx + 1);
          idx[0] = 0;
          std::swap(idx[0], idx[rng.below(k)]);
          break;
        }
        case Routing::OneRank: {
          // As many slots as possible on the last rank's experts, the rest elsewhere.
          const int64_t first = (W - 1) * e_loc, on_rank = std::min(k, e_loc);
          std::vector<int64_t> mine(all.begin() + first, all.end());
          std::vector<int64_t> other(all.begin(), all.begin() + first);
          draw_distinct(mine, std::vector<double>(mine.size(), 1.0), on_rank, rng, idx);
          draw_distinct(other, std::vector<double>(other.size(), 1.0), k - on_rank, rng, idx + on_rank);
          break;
        }
      }
      for (int64_t j = 0; j < k; ++j) in.topk_w[sz(t * k + j)] = static_cast<float>(0.05 + 0.95 * rng.uniform());
      if (routing == Routing::EmptySlots) {
        const bool all_empty = rng.uniform() < 0.05;
        for (int64_t j = 0; j < k; ++j) {
          if (all_empty || rng.uniform() < 0.3) {
            idx[j] = -1;
            in.topk_w[sz(t * k + j)] = 0.0f;
          }
        }
        if (!all_empty && rng.uniform() < 0.1) in.topk_w[sz(t * k)] = 0.0f;  // zero weight, live slot
      }
    }
  }
  return wl;
}

}  // namespace mok
