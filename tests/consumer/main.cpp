// A user's program against mok's public headers only (see CMakeLists.txt next to it). Without a
// GPU it runs the CPU reference engine on a tiny two-rank workload and the GEMM engine's host
// helpers, and it takes the address of a GPU-layer member so that linking pulls in mok::layer
// and what it depends on (the GEMM kernels, the CUDA runtime, NCCL). Prints one line per check
// and "mok consumer: ok" at the end; exit code 1 on a failed check.
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "mok/errors.hpp"
#include "mok/gemm.hpp"
#include "mok/layer.hpp"
#include "mok/reference.hpp"
#include "mok/workload.hpp"

namespace {

// FNV-1a over bf16 bit patterns: the reference's outputs are bitwise defined, so is this.
uint64_t fnv1a(std::span<const mok::bf16> values, uint64_t h) {
  for (const mok::bf16 v : values) {
    for (int byte = 0; byte < 2; ++byte) {
      h ^= (v.bits >> (8 * byte)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

// Stored in a volatile object so the reference survives optimization and must be resolved by
// the linker (the member itself needs a GPU to run; it is never called here).
void (mok::Layer::*volatile g_layer_check)() = &mok::Layer::check;

}  // namespace

int main() {
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    std::printf("%s: %s\n", what, ok ? "ok" : "FAILED");
    failures += ok ? 0 : 1;
  };

  // Two ranks, 8 tokens each, H = I = 64, 4 experts, top-2, a shared expert.
  const mok::LayerShape shape = mok::LayerShape::uniform(2, 8, 64, 64, 4, 2, 64);
  const mok::Workload wl = mok::make_workload(shape, mok::Routing::Uniform, 7);
  const mok::ref::Engine engine(shape, mok::Config{.cpu_threads = 1});
  const mok::ref::ForwardResult fwd = engine.forward(wl.inputs, wl.weights);
  uint64_t sum = 0xcbf29ce484222325ull;
  size_t values = 0;
  for (const std::vector<mok::bf16>& out : fwd.out) {
    sum = fnv1a(out, sum);
    values += out.size();
  }
  check(values == 2 * 8 * 64, "reference forward output size");
  std::printf("reference forward checksum: %016llx\n", static_cast<unsigned long long>(sum));

  // The reference is bitwise independent of the number of ranks: the same 16 tokens on one rank
  // (both ranks' inputs, concatenated) give the same output bits.
  const mok::LayerShape one_shape = mok::LayerShape::uniform(1, 16, 64, 64, 4, 2, 64);
  std::vector<mok::ref::RankInput> one(1);
  std::vector<mok::bf16> expected;
  for (size_t r = 0; r < wl.inputs.size(); ++r) {
    const mok::ref::RankInput& in = wl.inputs[r];
    one[0].x.insert(one[0].x.end(), in.x.begin(), in.x.end());
    one[0].topk_idx.insert(one[0].topk_idx.end(), in.topk_idx.begin(), in.topk_idx.end());
    one[0].topk_w.insert(one[0].topk_w.end(), in.topk_w.begin(), in.topk_w.end());
    expected.insert(expected.end(), fwd.out[r].begin(), fwd.out[r].end());
  }
  const mok::ref::ForwardResult one_fwd =
      mok::ref::Engine(one_shape, mok::Config{.cpu_threads = 1}).forward(one, wl.weights);
  check(fnv1a(one_fwd.out[0], 0xcbf29ce484222325ull) == fnv1a(expected, 0xcbf29ce484222325ull),
        "reference forward on 1 rank == on 2 ranks");

  // The GEMM engine's host packing: row packed_gate_row(i) of W1p[e] is gate row i.
  const int64_t E = shape.experts, I = shape.intermediate, H = shape.hidden;
  std::vector<uint16_t> w1p(static_cast<size_t>(E * 2 * I * H));
  static_assert(sizeof(mok::bf16) == sizeof(uint16_t));
  mok::gemm::pack_gate_up_host(&wl.weights.w_gate[0].bits, &wl.weights.w_up[0].bits, w1p.data(), E, I, H);
  const int64_t e = E - 1, i = I - 3;
  check(w1p[static_cast<size_t>((e * 2 * I + mok::gemm::packed_gate_row(i)) * H)] ==
                wl.weights.w_gate[static_cast<size_t>((e * I + i) * H)].bits &&
            w1p[static_cast<size_t>((e * 2 * I + mok::gemm::packed_up_row(i)) * H + 5)] ==
                wl.weights.w_up[static_cast<size_t>((e * I + i) * H + 5)].bits,
        "gemm pack_gate_up_host");

  // A plan is validated before any GPU call: a bad K is named in a mok::Error.
  bool rejected = false;
  try {
    std::vector<int32_t> tile_expert(1, 0);
    mok::gemm::plan_fc2({.a = w1p.data(), .w = w1p.data(), .y = w1p.data(), .k = 7, .n = 64,
                         .experts = E, .tile_expert = tile_expert.data(), .num_m_tiles = 1});
  } catch (const mok::Error& err) {
    rejected = true;
    std::printf("gemm plan_fc2 with k = 7 -> %s\n", err.what());
  }
  check(rejected, "gemm plan validation");
  check(g_layer_check != nullptr, "mok::Layer linked");

  if (failures > 0) return 1;
  std::printf("mok consumer: ok\n");
  return 0;
}
