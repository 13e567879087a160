// mok_bench's GPU mode: the GPU layer on every visible GPU (one EP rank each, one process), at
// the model shapes, after a sampled check against the spec's arithmetic. Timing: per iteration
// the slowest rank's CUDA-event time of one forward(); the median over iterations is reported.
// Ablation variants (other path, comm SMs, minibatch, ring size) run on the same inputs, and their
// sampled outputs must equal the main variant's bit for bit (the layer is deterministic and its
// results do not depend on how the work is split).
#include "gpu_layer_bench.h"
#include "gpu_layer_json.h"
#include "gpu_layer_variants.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <memory>
#include <mutex>

#include "common/cuda_check.h"
#include "common/device_fill.h"
#include "mok/comm.hpp"
#include "mok/errors.hpp"
#include "mok/layer.hpp"
#include "mok/memory.hpp"
#include "mok/schedule.hpp"
#include "reference/token_spec.h"
#include "schedule/schedule_math.h"
#include "util/bench_util.h"
#include "util/peer_copy.h"

namespace mok::bench {

namespace {

struct Model {
  const char* name;
  int64_t H, I, E, k;
};
constexpr Model kModels[] = {{"dsv3", 7168, 2048, 256, 8},
                             {"qwen3-30b-a3b", 2048, 768, 128, 8},
                             {"qwen3-235b", 4096, 1536, 128, 8}};

struct RankWeights {
  void* gate = nullptr;
  void* up = nullptr;
  void* down = nullptr;
};

// Expert e's weights as floats, [gate I x H | up I x H | down H x I], fetched once.
// FP8 / MXFP8: as their codes decode (the spec's forward in that precision holds them so).
const std::vector<float>& expert_weights(const Model& m, const std::vector<RankWeights>& w, int64_t e_loc, int64_t e,
                                         std::map<int64_t, std::vector<float>>& cache, Precision p) {
  auto it = cache.find(e);
  if (it != cache.end()) return it->second;
  const int64_t H = m.H, I = m.I;
  std::vector<bf16> raw(static_cast<size_t>(3 * I * H));
  const RankWeights& rw = w[static_cast<size_t>(e / e_loc)];
  const size_t off = static_cast<size_t>((e % e_loc) * I * H);
  MOK_CUDA_CHECK(cudaMemcpy(raw.data(), static_cast<bf16*>(rw.gate) + off, I * H * 2, cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaMemcpy(raw.data() + I * H, static_cast<bf16*>(rw.up) + off, I * H * 2, cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaMemcpy(raw.data() + 2 * I * H, static_cast<bf16*>(rw.down) + off, I * H * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) f[i] = float(raw[i]);
  ref::fp8_round_weights(H, I, f.data(), p);
  return cache.emplace(e, std::move(f)).first->second;
}

// The spec for one token (src/reference/token_spec.h), with the experts' weights fetched from
// the GPU once each.
std::vector<float> expected_token(const Model& m, const std::vector<RankWeights>& w, int64_t e_loc,
                                  const std::vector<float>& x, const int32_t* idx, const float* wt,
                                  std::map<int64_t, std::vector<float>>& cache, Precision p = Precision::BF16) {
  return ref::token_forward(
      m.H, m.I, m.k, x.data(), idx, wt, [&](int32_t e) { return expert_weights(m, w, e_loc, e, cache, p).data(); },
      p);
}

// The spec's backward for one token (no shared expert): d_x (H values) followed by d_topk_w (k).
std::vector<float> expected_backward_token(const Model& m, const std::vector<RankWeights>& w, int64_t e_loc,
                                           const std::vector<float>& x, const std::vector<float>& d_out,
                                           const int32_t* idx, const float* wt,
                                           std::map<int64_t, std::vector<float>>& cache) {
  return ref::token_backward(m.H, m.I, m.k, x.data(), d_out.data(), idx, wt,
                             [&](int32_t e) { return expert_weights(m, w, e_loc, e, cache, Precision::BF16).data(); });
}

// Relative L2 error of the GPU's values for the sampled tokens (samples[q] of every rank):
// want(r, q, t, x_row) gives the spec's `width` values for token t of rank r, got(r, q, c) the GPU's
// value c. A NaN from the GPU makes it infinite.
template <typename Want, typename Got>
double sampled_rel_err(const Workload& wl, int W, int64_t H, const int64_t (&samples)[2], int64_t width, Want want,
                       Got got) {
  double num = 0, den = 0;
  for (int r = 0; r < W; ++r) {
    const auto& in = wl.inputs[static_cast<size_t>(r)];
    for (int q = 0; q < 2; ++q) {
      const int64_t t = samples[q];
      std::vector<float> xv(static_cast<size_t>(H));
      for (int64_t c = 0; c < H; ++c) xv[c] = float(in.x[t * H + c]);
      const std::vector<float> w = want(r, q, t, xv);
      for (int64_t c = 0; c < width; ++c) {
        const double a = got(r, q, c), b = w[c];
        num += std::isnan(a) ? INFINITY : (a - b) * (a - b);
        den += b * b;
      }
    }
  }
  return std::sqrt(num / std::max(den, 1e-30));
}


// The current device's free memory (after the device is idle). mok_bench has the GPUs to itself,
// so differences around a layer's construction and first backward are its memory.
int64_t free_device_bytes() {
  size_t free = 0, total = 0;
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  MOK_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free);
}

// One rank's device inputs (x, routing, weights of its tokens) and output for a workload, and a
// layer built on them; freed on destruction.
struct RankRun {
  void *x = nullptr, *idx = nullptr, *w = nullptr, *out = nullptr;
  int64_t T = 0, H = 0;
  int64_t built_bytes = 0;  // the device's free memory before the layer was built minus after
  bool windows_from_pool = false;  // its symmetric windows were an earlier layer's (not in built_bytes)
  RoutingRefs refs;
  std::unique_ptr<Layer> layer;
  RankRun(comm::Communicator& c, const LayerShape& shape, const Config& cfg, const ref::RankInput& in,
          const RankWeights& rw)
      : T(shape.tokens_of(c.rank())), H(shape.hidden) {
    const int64_t k = shape.top_k;
    MOK_CUDA_CHECK(cudaMalloc(&x, in.x.size() * 2));
    MOK_CUDA_CHECK(cudaMalloc(&idx, in.topk_idx.size() * 4));
    MOK_CUDA_CHECK(cudaMalloc(&w, in.topk_w.size() * 4));
    MOK_CUDA_CHECK(cudaMalloc(&out, static_cast<size_t>(std::max<int64_t>(1, T * H)) * 2));
    MOK_CUDA_CHECK(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    MOK_CUDA_CHECK(cudaMemcpy(idx, in.topk_idx.data(), in.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    MOK_CUDA_CHECK(cudaMemcpy(w, in.topk_w.data(), in.topk_w.size() * 4, cudaMemcpyHostToDevice));
    const DeviceWeights dw = DeviceWeights::bf16(shape, rw.gate, rw.up, rw.down);
    const int64_t before = free_device_bytes();
    const size_t windows_before = c.window_count();
    layer = std::make_unique<Layer>(c, shape, cfg, dw);
    built_bytes = before - free_device_bytes();
    windows_from_pool = c.window_count() == windows_before;
    refs = RoutingRefs{TensorRef::contiguous(x, DType::BF16, {T, H}), TensorRef::contiguous(idx, DType::I32, {T, k}),
                       TensorRef::contiguous(w, DType::F32, {T, k})};
  }
  TensorRef out_ref() const { return TensorRef::contiguous(out, DType::BF16, {T, H}); }
  ~RankRun() {
    layer.reset();
    for (void* p : {x, idx, w, out}) cudaFree(p);
  }
  RankRun(const RankRun&) = delete;
  RankRun& operator=(const RankRun&) = delete;
};

// Sustained rate of `cfg` at one shape: ~sustain_s seconds of back-to-back forwards, the mean
// time per forward over the second half, slowest rank. The count comes from the FLOPs at
// 400 TF/s (equal on every rank: every forward is collective), at least 2 x iters, at most 1e6.
// No host waits in between (a rank whose host waited would hold the other GPU in the next
// barrier); a full launch queue blocks the host instead and keeps the GPU fed. Under the power
// cap the clock swings with a period of ~1 s (measured 1.11-1.35 GHz at 700 W), so the window
// must span seconds: the last 20 forwards alone measured 12.5-13.7 ms on DeepSeek-V3.
// `runs`: each rank's run of the main variant (kept from its timed iterations: a new Layer would
// register new symmetric windows), released here.
double sustained_ms(comm::LocalGroup& group, std::vector<std::unique_ptr<RankRun>>& runs, double flops,
                    const GpuBenchOptions& o, int& count) {
  count = static_cast<int>(std::min(1e6, std::max(2.0 * o.iters, std::ceil(o.sustain_s / (flops / 400e12)))));
  const int n = count;
  std::vector<double> per_forward(runs.size(), 0.0);
  group.run([&](comm::Communicator& c, size_t r) {
    RankRun& run = *runs[r];
    cudaStream_t s = c.stream();
    cudaEvent_t mid = nullptr, end = nullptr;
    MOK_CUDA_CHECK(cudaEventCreate(&mid));
    MOK_CUDA_CHECK(cudaEventCreate(&end));
    for (int it = 0; it < n; ++it) {
      if (it == n / 2) MOK_CUDA_CHECK(cudaEventRecord(mid, s));
      run.layer->forward(run.refs, run.out_ref(), s, o.precision == Precision::BF16);  // FP8: forward only
    }
    MOK_CUDA_CHECK(cudaEventRecord(end, s));
    MOK_CUDA_CHECK(cudaStreamSynchronize(s));
    run.layer->check();
    float e = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&e, mid, end));
    per_forward[r] = double(e) / double(n - n / 2);
    cudaEventDestroy(mid);
    cudaEventDestroy(end);
    runs[r].reset();  // on this rank's device
  });
  return *std::max_element(per_forward.begin(), per_forward.end());
}

// One rank's backward: random d_out, one checked forward + backward (sampled d_x rows and their
// d_topk_w, with the d_out rows they came from), then per iteration an untimed forward and a timed
// backward (events `ev`, reused from the forward timing). Every call is collective.
// warmup + iters iterations on stream s: before() untimed, then fn() between two of the events
// `ev` (2 per iteration); returns the times of the iterations after the warm-up (ms). Raises the
// layer's device-side errors.
template <typename Before, typename Fn>
std::vector<double> event_times(Layer& layer, const GpuBenchOptions& o, cudaStream_t s, std::vector<cudaEvent_t>& ev,
                                Before before, Fn fn) {
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    before();
    MOK_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(2 * it)], s));
    fn();
    MOK_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(2 * it + 1)], s));
  }
  MOK_CUDA_CHECK(cudaStreamSynchronize(s));
  layer.check();
  std::vector<double> ms;
  for (int it = o.warmup; it < o.warmup + o.iters; ++it) {
    float e = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&e, ev[static_cast<size_t>(2 * it)], ev[static_cast<size_t>(2 * it + 1)]));
    ms.push_back(e);
  }
  return ms;
}

// With MOK_PROFILE=1, `profile` gets the last backward's stage times (Layer::profile_summary).
void time_backward(Layer& layer, const RoutingRefs& refs, void* out, const LayerShape& shape, int rank,
                   const int64_t (&samples)[2], const GpuBenchOptions& o, cudaStream_t s, std::vector<double>& ms,
                   std::vector<float>& sampled, std::vector<float>& dout_sampled, std::vector<cudaEvent_t>& ev,
                   std::string& profile, int64_t& first_backward_bytes, bool accumulate) {
  const int64_t T = shape.tokens_of(rank), H = shape.hidden, k = shape.top_k, I = shape.intermediate,
                e_loc = shape.local_experts();
  void* d_out = nullptr;
  void* bufs[5] = {};
  const size_t wb = accumulate ? 4 : 2;  // the weight gradients: fp32 added to, or bf16
  const size_t bytes[5] = {static_cast<size_t>(std::max<int64_t>(1, T * H)) * 2,
                           static_cast<size_t>(std::max<int64_t>(1, T * k)) * 4, static_cast<size_t>(e_loc * I * H) * wb,
                           static_cast<size_t>(e_loc * I * H) * wb, static_cast<size_t>(e_loc * H * I) * wb};
  MOK_CUDA_CHECK(cudaMalloc(&d_out, bytes[0]));
  for (int i = 0; i < 5; ++i) MOK_CUDA_CHECK(cudaMalloc(&bufs[i], bytes[i]));
  DeviceGrads g = DeviceGrads::of(shape, rank, bufs[0], static_cast<float*>(bufs[1]), bufs[2], bufs[3], bufs[4]);
  if (accumulate) {
    for (int i = 2; i < 5; ++i) MOK_CUDA_CHECK(cudaMemsetAsync(bufs[i], 0, bytes[i], s));
    g.d_w_gate = TensorRef::contiguous(bufs[2], DType::F32, {e_loc, I, H});
    g.d_w_up = TensorRef::contiguous(bufs[3], DType::F32, {e_loc, I, H});
    g.d_w_down = TensorRef::contiguous(bufs[4], DType::F32, {e_loc, H, I});
    g.accumulate = true;
  }
  const TensorRef oref = TensorRef::contiguous(out, DType::BF16, {T, H});
  gpu::fill_normal_bf16(d_out, T * H, 9001 + static_cast<uint64_t>(rank), 1.0f, s);
  const TensorRef dref = TensorRef::contiguous(d_out, DType::BF16, {T, H});
  layer.forward(refs, oref, s);
  const int64_t before = free_device_bytes();  // the first backward allocates the backward's buffers
  layer.backward(refs, dref, g, s);
  MOK_CUDA_CHECK(cudaStreamSynchronize(s));
  first_backward_bytes = before - free_device_bytes();
  layer.check();
  for (int64_t t : samples) {
    std::vector<bf16> row(static_cast<size_t>(H)), drow(static_cast<size_t>(H));
    std::vector<float> w(static_cast<size_t>(k));
    MOK_CUDA_CHECK(cudaMemcpy(row.data(), static_cast<const bf16*>(g.d_x.data) + t * H, H * 2, cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(drow.data(), static_cast<bf16*>(d_out) + t * H, H * 2, cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(w.data(), static_cast<const float*>(g.d_topk_w.data) + t * k, k * 4, cudaMemcpyDeviceToHost));
    for (const bf16 v : row) sampled.push_back(float(v));
    sampled.insert(sampled.end(), w.begin(), w.end());
    for (const bf16 v : drow) dout_sampled.push_back(float(v));
  }
  ms = event_times(
      layer, o, s, ev, [&] { layer.forward(refs, oref, s); }, [&] { layer.backward(refs, dref, g, s); });
  const std::string summary = layer.profile_summary();
  const size_t at = summary.find("backward stages");
  if (at != std::string::npos) profile = summary.substr(at);
  cudaFree(d_out);
  for (void* p : bufs) cudaFree(p);
}

}  // namespace

int run_gpu_layer_bench(const GpuBenchOptions& o) {
  const int W = gpu_count();
  MOK_REQUIRE(W >= 1, "GPUs", "the GPU benchmark needs at least one visible GPU");
  MOK_REQUIRE(o.iters >= 20, "--iters", "at least 20 timed iterations are required, got ", o.iters);
  std::vector<int> devices(static_cast<size_t>(W));
  for (int g = 0; g < W; ++g) devices[static_cast<size_t>(g)] = g;
  comm::CommOptions copt;
  copt.config.fwd_comm_sms = o.comm_sms;
  copt.config.macrobatch_tokens = o.macrobatch;
  const std::string sms_text = o.comm_sms > 0 ? std::to_string(o.comm_sms) : std::string("shape-chosen");
  std::printf("[mok_bench] GPU layer (%s) on %d x %s, EP %d, %s comm SMs, %d warm-up + %d timed iterations%s\n",
              to_string(o.path), W, device_name().c_str(), W, sms_text.c_str(), o.warmup, o.iters,
              o.ablation ? ", with ablation variants" : "");
  auto group = comm::LocalGroup::create(devices, copt);
  // The NVLink copy ceiling of this run (before any weights take the memory it needs).
  const std::vector<PeerCopy> copy_rates = neighbour_copy_rates(W);
  const double ceiling = copy_ceiling_GBps(copy_rates);
  std::string copy_json;
  for (const PeerCopy& c : copy_rates) {
    std::printf("[mok_bench] NVLink copy: cudaMemcpyPeer 1 GiB GPU%d -> GPU%d %.1f GB/s\n", c.src, c.dst, c.GBps);
    copy_json += std::string(copy_json.empty() ? "" : ", ") + "{\"src\": " + std::to_string(c.src) +
                 ", \"dst\": " + std::to_string(c.dst) + ", \"GBps\": " + std::to_string(c.GBps) + "}";
  }
  if (ceiling > 0) std::printf("[mok_bench] NVLink copy ceiling (the largest one-way rate): %.1f GB/s\n", ceiling);
  std::string cases, ablation;
  std::printf("| model | T/rank | routing | variant | comm SMs | minibatch | ring | check | mok ms (slowest rank, median) | TFLOP/s per GPU |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& name : o.models) {
    const Model* m = nullptr;
    const size_t cut = name.find('/');
    for (const auto& c : kModels)
      if (name.substr(0, cut) == c.name) m = &c;
    MOK_REQUIRE(m != nullptr, "--models", "unknown model '", name, "' (dsv3, qwen3-30b-a3b, qwen3-235b, each optionally /ep8)");
    // "/epS": the slice one rank of EP S computes, on each of our W GPUs: E * W / S experts in all.
    const int slice = cut == std::string::npos ? 0 : std::atoi(name.c_str() + cut + 3);
    MOK_REQUIRE(slice == 0 || (name.compare(cut, 3, "/ep") == 0 && slice >= W && m->E * W % slice == 0), "--models",
                "'", name, "': a slice is /epS with S >= ", W, " GPUs dividing E * GPUs");
    const int64_t E = slice ? m->E * W / slice : m->E;
    MOK_REQUIRE(E % W == 0, "GPUs", name, " has ", E, " experts, not divisible by ", W, " ranks");
    const std::string model = name;
    const int64_t H = m->H, I = m->I, k = m->k, e_loc = E / W;
    // A slice stands for one rank of EP `slice`: its variants get the comm SMs that rank would
    // choose (Config::resolved_fwd_comm_sms has a rule of its own for the megakernel on one GPU).
    std::optional<LayerShape> ep_shape;
    if (slice > 0) ep_shape = LayerShape::uniform(slice, 8192, H, I, m->E, k, 0);
    std::vector<RankWeights> weights(static_cast<size_t>(W));
    group.run([&](comm::Communicator& c, size_t r) {
      RankWeights& rw = weights[r];
      const size_t n = static_cast<size_t>(e_loc * I * H);
      MOK_CUDA_CHECK(cudaMalloc(&rw.gate, n * 2));
      MOK_CUDA_CHECK(cudaMalloc(&rw.up, n * 2));
      MOK_CUDA_CHECK(cudaMalloc(&rw.down, n * 2));
      gpu::fill_normal_bf16(rw.gate, static_cast<int64_t>(n), 3 * r + 1, 1.0f / std::sqrt(float(H)), c.stream());
      gpu::fill_normal_bf16(rw.up, static_cast<int64_t>(n), 3 * r + 2, 1.0f / std::sqrt(float(H)), c.stream());
      gpu::fill_normal_bf16(rw.down, static_cast<int64_t>(n), 3 * r + 3, 1.0f / std::sqrt(float(I)), c.stream());
      MOK_CUDA_CHECK(cudaStreamSynchronize(c.stream()));
    });
    for (int64_t T : o.tokens) {
      for (Routing routing : o.routings) {
        const LayerShape shape = LayerShape::uniform(W, T, H, I, E, k, 0);
        const Workload wl = make_workload(shape, routing, 2026 + static_cast<uint64_t>(T), 0);
        const std::string tiles_json = tile_stats_json(shape, wl);
        const std::vector<int64_t> link_rows = nvlink_rows_per_rank(shape, wl);
        const int64_t samples[2] = {0, T / 2 + 1};
        const double flops = 2.0 * double(T) * double(k) * 3.0 * double(H) * double(I);  // per GPU
        std::vector<std::vector<bf16>> main_sampled;
        std::string main_case;  // the main variant's JSON entry, closed after the sustained run
        double main_ms = 0;     // the main variant's median, for the drift line of its repeat
        std::vector<std::unique_ptr<RankRun>> main_runs(static_cast<size_t>(W));
        double rel = 0;
        const std::vector<Variant> variants = variants_for(o, shape, ep_shape ? &*ep_shape : nullptr);
        for (const Variant& var : variants) {
          const Config& cfg = var.cfg;
          std::vector<std::vector<double>> ms(static_cast<size_t>(W));
          std::vector<std::vector<bf16>> sampled(static_cast<size_t>(W));
          std::vector<uint64_t> out_hash(static_cast<size_t>(W), 0);  // FNV-1a of out, per rank
          std::vector<std::string> profile(static_cast<size_t>(W));
          const bool keep = o.sustain_s > 0 && &var == &variants.front();  // for the sustained run
          // The main variant's backward (over windows when its ring is below the worst case), and
          // the memory-mode variants'.
          // (FP8: the megakernel with a resident ring is forward only.)
          const bool bwd = o.backward && trains(cfg, shape) && (&var == &variants.front() || var.time_backward);
          std::vector<std::vector<double>> bwd_ms(static_cast<size_t>(W));
          std::vector<std::vector<float>> bwd_sampled(static_cast<size_t>(W)), dout_sampled(static_cast<size_t>(W));
          std::vector<std::string> bwd_profile(static_cast<size_t>(W));
          std::vector<int64_t> built(static_cast<size_t>(W), 0), bwd_bytes(static_cast<size_t>(W), -1);
          std::vector<char> from_pool(static_cast<size_t>(W), 0);
          group.run([&](comm::Communicator& c, size_t r) {
            std::unique_ptr<RankRun> owned = std::make_unique<RankRun>(c, shape, cfg, wl.inputs[r], weights[r]);
            RankRun& run = *owned;
            built[r] = run.built_bytes;
            from_pool[r] = run.windows_from_pool ? 1 : 0;
            if (keep) main_runs[r] = std::move(owned);
            Layer& layer = *run.layer;
            void* out = run.out;
            RoutingRefs refs = run.refs;
            cudaStream_t s = c.stream();
            if (var.x_in_window) {  // the caller writes x where the peers read it
              if (T > 0) {
                MOK_CUDA_CHECK(cudaMemcpy(layer.input_buffer(), run.x, static_cast<size_t>(T * H) * 2,
                                          cudaMemcpyDeviceToDevice));
                refs.x.data = layer.input_buffer();
              }
              MOK_CUDA_CHECK(cudaDeviceSynchronize());
              c.host_barrier();  // every rank's x in place before any forward pulls it
            }
            MOK_CUDA_CHECK(cudaMemsetAsync(out, 0xff, static_cast<size_t>(T * H) * 2, s));  // poison
            layer.forward(refs, run.out_ref(), s, var.save_for_backward);
            MOK_CUDA_CHECK(cudaStreamSynchronize(s));
            layer.check();
            {  // the whole output's bits, for bitwise comparisons across builds (runtime-ab)
              std::vector<uint8_t> bytes(static_cast<size_t>(T * H) * 2);
              MOK_CUDA_CHECK(cudaMemcpy(bytes.data(), out, bytes.size(), cudaMemcpyDeviceToHost));
              uint64_t h = 1469598103934665603ull;
              for (uint8_t v : bytes) h = (h ^ v) * 1099511628211ull;
              out_hash[r] = h;
            }
            for (int64_t t : samples) {
              const size_t at = sampled[r].size();
              sampled[r].resize(at + static_cast<size_t>(H));
              MOK_CUDA_CHECK(cudaMemcpy(sampled[r].data() + at, static_cast<bf16*>(out) + t * H, H * 2, cudaMemcpyDeviceToHost));
            }
            std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * (o.warmup + o.iters)));
            for (auto& e : ev) MOK_CUDA_CHECK(cudaEventCreate(&e));
            ms[r] = event_times(
                layer, o, s, ev, [] {}, [&] { layer.forward(refs, run.out_ref(), s, var.save_for_backward); });
            profile[r] = layer.profile_summary();
            if (bwd)
              time_backward(layer, refs, out, shape, static_cast<int>(r), samples, o, s, bwd_ms[r], bwd_sampled[r],
                            dout_sampled[r], ev, bwd_profile[r], bwd_bytes[r], var.accumulate_wgrad);
            for (auto& e : ev) cudaEventDestroy(e);
          });
          std::string check;
          if (main_sampled.empty()) {
            // Sampled check against the spec's arithmetic (2 tokens per rank, all their experts).
            std::map<int64_t, std::vector<float>> cache;
            rel = sampled_rel_err(
                wl, W, H, samples, H,
                [&](int r, int, int64_t t, const std::vector<float>& xv) {
                  const auto& in = wl.inputs[static_cast<size_t>(r)];
                  return expected_token(*m, weights, e_loc, xv, &in.topk_idx[t * k], &in.topk_w[t * k], cache,
                                        cfg.precision);
                },
                [&](int r, int q, int64_t c) { return double(float(sampled[r][q * H + c])); });
            MOK_REQUIRE(rel < 1e-2, "GPU layer check", "sampled outputs must match the spec within 1e-2 (",
                        model, " T=", T, " ", to_string(routing), ": rel err ", rel, ")");
            main_sampled = sampled;
            char buf[32];
            std::snprintf(buf, sizeof buf, "rel %.1e", rel);
            check = buf;
          } else {
            int64_t differ = 0;
            for (int r = 0; r < W; ++r)
              for (size_t i = 0; i < sampled[r].size(); ++i) differ += sampled[r][i].bits != main_sampled[r][i].bits;
            MOK_REQUIRE(differ == 0, "GPU layer check", "every variant must give the main variant's bits (",
                        model, " T=", T, " ", to_string(routing), " ", var.name, ": ", differ, " values differ)");
            check = "bitwise";
          }
          std::vector<double> slowest(static_cast<size_t>(o.iters), 0.0);
          for (int r = 0; r < W; ++r)
            for (int it = 0; it < o.iters; ++it) slowest[it] = std::max(slowest[it], ms[r][it]);
          const double t_ms = median(slowest);
          const double tflops = flops / (t_ms * 1e-3) / 1e12;
          const int64_t mb = cfg.resolved_minibatch(shape, device_sms()),
                        ring = cfg.resolved_macrobatch(shape, device_sms());
          const int sms = cfg.resolved_fwd_comm_sms(shape);
          std::printf("| %s | %lld | %s | %s | %d | %lld | %lld | %s | %.3f | %.0f |\n", model.c_str(), (long long)T,
                      to_string(routing), var.name.c_str(), sms, (long long)mb, (long long)ring, check.c_str(),
                      t_ms, tflops);
          for (int r = 0; r < W; ++r)
            if (!profile[r].empty()) std::printf("  profile rank %d: %s\n", r, profile[r].c_str());
          std::fflush(stdout);
          const std::string key = "{\"model\": \"" + model + "\", \"T\": " + std::to_string(T) +
                                  (slice ? ", \"slice_of_ep\": " + std::to_string(slice) + ", \"experts\": " +
                                               std::to_string(E)
                                         : std::string()) +
                                  ", \"routing\": \"" + to_string(routing) + "\", \"variant\": \"" + var.name +
                                  "\", \"precision\": \"" + to_string(cfg.precision) + "\"";
          const std::string knobs = ", \"comm_sms\": " + std::to_string(sms) + ", \"minibatch_tokens\": " +
                                    std::to_string(mb) + ", \"macrobatch_tokens\": " + std::to_string(ring);
          // This variant's ablation entry, closed after its backward (memory-mode variants).
          std::string entry = key + knobs + ", \"ms\": " + std::to_string(t_ms) + ", \"tflops\": " + std::to_string(tflops);
          if (&var == &variants.front()) {  // the main variant (checked against the spec)
            main_ms = t_ms;
            std::string hashes;
            for (uint64_t h : out_hash) {
              char hb[24];
              std::snprintf(hb, sizeof hb, "%s\"%016llx\"", hashes.empty() ? "" : ", ", (unsigned long long)h);
              hashes += hb;
            }
            main_case = key + ", \"out_hash\": [" + hashes + "]" + ", \"mok_ms\": " + std::to_string(t_ms) + ", \"mok_tflops\": " +
                        std::to_string(tflops) + knobs + ", \"check_rel_err\": " + std::to_string(rel) + tiles_json +
                        memory_json(shape, cfg, built[0], bwd ? bwd_bytes[0] : -1, from_pool[0] != 0);
            {
              const MemoryPlan plan = plan_memory(shape, cfg, 0, device_sms());
              std::printf("  memory per layer (plan, rank 0): %.2f GB (saved for the backward %.2f GB, backward's own "
                          "%.2f GB), weights not counted; measured at construction %.2f GB (plan %.2f GB)\n",
                          double(plan.total()) * 1e-9, double(plan.total(MemoryScope::Saved)) * 1e-9,
                          double(plan.total(MemoryScope::Backward)) * 1e-9, double(built[0]) * 1e-9,
                          double(plan.total() - plan.total(MemoryScope::Backward)) * 1e-9);
            }
            if (W >= 2) {
              const LinkRate l = link_rate(link_rows, H, t_ms);
              main_case += nvlink_json(link_rows, H, l, ceiling);
              std::printf("  NVLink: %.0f MB per rank and direction, %.0f GB/s over the forward (%.0f%% of the %.0f GB/s copy ceiling)\n",
                          static_cast<double>(l.most_bytes) / 1e6, l.gbps, ceiling > 0 ? 100.0 * l.gbps / ceiling : 0.0,
                          ceiling);
            }
          }
          if (bwd) {
            // Sampled check of the backward against the spec (the same 2 tokens per rank), then
            // the slowest rank's median. Backward FLOPs: twice the forward's (two dgrads, two wgrads).
            std::map<int64_t, std::vector<float>> cache;
            const double brel = sampled_rel_err(
                wl, W, H, samples, H + k,
                [&](int r, int q, int64_t t, const std::vector<float>& xv) {
                  const auto& in = wl.inputs[static_cast<size_t>(r)];
                  const std::vector<float> dv(dout_sampled[r].begin() + q * H, dout_sampled[r].begin() + (q + 1) * H);
                  return expected_backward_token(*m, weights, e_loc, xv, dv, &in.topk_idx[t * k], &in.topk_w[t * k],
                                                 cache);
                },
                [&](int r, int q, int64_t c) { return double(bwd_sampled[r][q * (H + k) + c]); });
            // The spec is the bf16 one: an FP8 backward is checked against it within the recipe's own
            // error (~6e-2 on these Gaussian weights; the GPU tests check it against the FP8 spec).
            const bool fp8_bwd = cfg.precision != Precision::BF16;
            const double bwd_tol = fp8_bwd ? 0.15 : 1e-2;
            MOK_REQUIRE(brel < bwd_tol, "GPU layer backward check", "sampled d_x and d_topk_w must match the ",
                        fp8_bwd ? "bf16 spec within the FP8 recipe's error, 0.15 (" : "spec within 1e-2 (", model,
                        " T=", T, " ", to_string(routing), ": rel err ", brel, ")");
            std::vector<double> bslow(static_cast<size_t>(o.iters), 0.0);
            for (int r = 0; r < W; ++r)
              for (int it = 0; it < o.iters; ++it) bslow[it] = std::max(bslow[it], bwd_ms[r][it]);
            const double b_ms = median(bslow), b_tflops = 2.0 * flops / (b_ms * 1e-3) / 1e12;
            std::printf("  backward: %.3f ms, %.0f TFLOP/s per GPU (slowest rank, median of %d; sampled d_x and "
                        "d_topk_w vs the %sspec: rel %.1e)\n", b_ms, b_tflops, o.iters, fp8_bwd ? "bf16 " : "", brel);
            for (int r = 0; r < W; ++r)
              if (!bwd_profile[r].empty()) std::printf("  profile rank %d: %s\n", r, bwd_profile[r].c_str());
            std::fflush(stdout);
            if (&var == &variants.front()) {
              main_case += ", \"mok_bwd_ms\": " + std::to_string(b_ms) + ", \"mok_bwd_tflops\": " +
                           std::to_string(b_tflops) + ", \"backward_path\": \"" + to_string(cfg.backward_path) +
                           "\", \"bwd_check_rel_err\": " + std::to_string(brel);
            } else {  // a memory mode or the other backward path: its backward beside the main variant's
              entry += ", \"bwd_ms\": " + std::to_string(b_ms) + ", \"bwd_tflops\": " + std::to_string(b_tflops) +
                       ", \"backward_path\": \"" + to_string(cfg.backward_path) + "\"" +
                       ", \"bwd_check_rel_err\": " + std::to_string(brel) +
                       memory_json(shape, cfg, built[0], bwd_bytes[0], from_pool[0] != 0);
              if (var.main_backward_twin)
                main_case += std::string(", \"mok_bwd_") + to_string(cfg.backward_path) + "_ms\": " + std::to_string(b_ms);
              if (var.accumulate_wgrad) {
                entry += ", \"wgrad_accumulate\": true";
                main_case += ", \"mok_bwd_accumulate_ms\": " + std::to_string(b_ms);
              }
            }
          } else if (o.backward && &var == &variants.front() && cfg.precision != Precision::BF16) {
            std::printf("  backward: not run (the %s megakernel with a resident ring is forward only so far; --path "
                        "unfused or a ring below the worst case trains)\n",
                        to_string(cfg.precision));
          } else if (o.backward && &var == &variants.front()) {
            std::printf("  backward: not run (the main variant's ring holds fewer rows than the worst case)\n");
          }
          if (!ablation.empty()) ablation += ",\n    ";
          ablation += entry + "}";
          if (var.repeat_of_main && main_ms > 0)
            std::printf("  drift: the main variant again, last: %.3f ms vs %.3f ms first (%+.1f%%)\n", t_ms, main_ms,
                        100.0 * (t_ms / main_ms - 1.0));
        }
        // The main variant's sustained rate, after every variant of the shape (so none of them
        // starts on a GPU this run has just heated to its power cap).
        if (o.sustain_s > 0) {
          int count = 0;
          const double s_ms = sustained_ms(group, main_runs, flops, o, count);
          const double s_tflops = s_ms > 0 ? flops / (s_ms * 1e-3) / 1e12 : 0.0;
          std::printf("  sustained (%s): %.3f ms, %.0f TFLOP/s per GPU (mean over the last %d of %d back-to-back forwards)\n",
                      variants.front().name.c_str(), s_ms, s_tflops, count - count / 2, count);
          std::fflush(stdout);
          if (s_ms > 0)
            main_case += ", \"mok_sustained_ms\": " + std::to_string(s_ms) + ", \"mok_sustained_tflops\": " +
                         std::to_string(s_tflops) + ", \"sustained_iterations\": " + std::to_string(count);
        }
        if (!cases.empty()) cases += ",\n    ";
        cases += main_case + "}";
      }
    }
    group.run([&](comm::Communicator&, size_t r) {
      cudaFree(weights[r].gate);
      cudaFree(weights[r].up);
      cudaFree(weights[r].down);
    });
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << "{" << json_meta(W) << ", \"ep\": " << W
      << ", \"what\": \"mok GPU layer forward (" << to_string(o.path)
      << "), slowest rank per iteration, median of " << o.iters << " after " << o.warmup
      << " warm-up; ablation variants checked bitwise against the main one"
      << (o.backward ? "; mok_bwd_ms: the main variant's backward (its backward_path: unfused = four GEMM kernels "
                       "in stream order, fused = the backward's GEMM program; over windows of the ring when it is "
                       "below the worst case) after an untimed forward, same statistic, FLOPs twice the forward's; "
                       "mok_bwd_<path>_ms: the other backward path in the same run (an ablation variant); "
                       "mok_bwd_accumulate_ms: the main variant's backward with the routed weights' gradients "
                       "added into fp32 ones (GradRefs::accumulate; unfused bf16 only; an ablation variant)"
                     : "")
      << (W >= 2 ? "; mok_nvlink_GBps: the busiest rank's NVLink bytes per direction (rows pulled in + rows"
                   " combined in) / the slowest rank's time"
                 : "")
      << (o.sustain_s > 0 ? "; mok_sustained_ms: slowest rank's mean time per forward over the second half of ~" +
                                seconds_text(o.sustain_s) + " s of back-to-back forwards (power-capped steady state)"
                          : std::string())
      << "\"";
    if (!copy_rates.empty())
      f << ", \"nvlink_copy_ceiling_GBps\": " << std::to_string(ceiling) << ", \"nvlink_copy_method\": \"cudaMemcpyPeerAsync, 1 GiB, "
        << "median of 5 after 2; the ceiling is the largest one-way rate\", \"nvlink_copy_rates\": [" << copy_json << "]";
    f << ", \"cases\": [\n    " << cases
      << "\n  ], \"ablation\": [\n    " << ablation << "\n  ]}\n";
    std::printf("[mok_bench] wrote %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace mok::bench
