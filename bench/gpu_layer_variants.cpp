// mok_bench's GPU mode: the variants of one shape (gpu_layer_variants.h).
#include "gpu_layer_variants.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "common/cuda_check.h"
#include "mok/errors.hpp"
#include "schedule/schedule_math.h"

namespace mok::bench {

// SMs of GPU 0 (every rank's GPU is one model): the minibatch and ring the layer resolves with.
int device_sms() {
  static const int n = [] {
    int v = 0;
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
    return v;
  }();
  return n;
}

bool trains(const Config& cfg, const LayerShape& shape) {
  return cfg.precision == Precision::BF16 || cfg.forward_path == ForwardPath::Unfused ||
         cfg.resolved_macrobatch(shape, device_sms()) < shape.worst_case_rows();
}

std::vector<Variant> variants_for(const GpuBenchOptions& o, const LayerShape& shape, const LayerShape* stands_for) {
  // Comm SMs chosen from the shape: a slice's are its EP-S rank's, resolved with the variant's own
  // settings (the combine path halves them).
  const auto shape_sms = [&](Config& c) {
    if (o.comm_sms == 0 && stands_for != nullptr) c.fwd_comm_sms = c.resolved_fwd_comm_sms(*stands_for);
  };
  Config main;
  main.forward_path = o.path;
  main.fwd_comm_sms = o.comm_sms;
  main.minibatch_tokens = o.minibatch;
  if (o.clusters >= 0) main.fwd_clusters = o.clusters != 0;
  main.dispatch = o.dispatch;
  main.backward_path = o.backward_path;
  main.precision = o.precision;
  main.fp8_keep_weight_codes_t = o.fp8_keep_weight_codes_t;
  // A multiple of this shape's minibatch (which the models' shapes choose differently).
  if (o.macrobatch > 0) main.macrobatch_tokens = sched::round_up(o.macrobatch, main.resolved_minibatch(shape, device_sms()));
  main.activation_budget_bytes = o.budget_mb < 0 ? -1 : o.budget_mb * 1000000;
  if (o.workspace_budget_mb == 0) {  // off: the layer's own buffers (every row resident)
    main.share_workspace = false;
    main.workspace_budget_bytes = 0;
  }
  if (o.workspace_budget_mb > 0) {  // the training memory model: one workspace, the ring that fits it
    main.macrobatch_tokens = 0;
    main.share_workspace = true;
    main.workspace_budget_bytes = o.workspace_budget_mb * 1000000;
  }
  shape_sms(main);
  std::vector<Variant> v{{to_string(o.path), main}};
  if (main.precision != Precision::BF16) {  // no variants to compare bitwise
    v[0].name = std::string(to_string(o.path)) + "-" + to_string(main.precision) +
                (main.fp8_keep_weight_codes_t ? "-kept" : "");
    // The FP8 megakernel with a resident ring is forward only (nothing saved); the unfused FP8
    // forward saves for its backward, and the megakernel over windows trains (it saves the routing).
    v[0].save_for_backward = trains(main, shape);
    if (!o.variants.empty()) std::printf("  (--variants ignored: no ablation in %s)\n", to_string(main.precision));
    return v;
  }
  if (!o.ablation) {
    if (!o.variants.empty()) std::printf("  (--variants ignored: --no-ablation)\n");
    return v;
  }
  // The variants vary one knob each around the main one's resolved ring: a budget would choose
  // another ring for another minibatch or dispatch (or none: the smallest ring is two of its
  // minibatches), so they get the main ring as an explicit one (rounded to their minibatch).
  // (A budget: workspace_budget_bytes > 0, or -1, the automatic one, with a shared workspace.)
  const auto budgeted = [](const Config& c) { return c.workspace_budget_bytes != 0 && c.share_workspace; };
  const int64_t main_ring = budgeted(main) && main.forward_path == ForwardPath::Megakernel && main.macrobatch_tokens == 0
                                ? main.resolved_macrobatch(shape, device_sms())
                                : 0;
  const auto at_main_ring = [&](Config c) {
    if (main_ring > 0 && budgeted(c)) {
      c.workspace_budget_bytes = 0;
      c.macrobatch_tokens = sched::round_up(main_ring, c.resolved_minibatch(shape, device_sms()));
    }
    return c;
  };
  Config other = main;
  other.forward_path = o.path == ForwardPath::Megakernel ? ForwardPath::Unfused : ForwardPath::Megakernel;
  if (other.forward_path == ForwardPath::Unfused) other.workspace_budget_bytes = 0;  // no ring to size
  v.push_back({to_string(other.forward_path), other});
  Config mk = main;
  mk.forward_path = ForwardPath::Megakernel;
  const int64_t mb = mk.resolved_minibatch(shape, device_sms());
  for (int sms : {4, 8, 16, 32}) {
    if (sms == main.resolved_fwd_comm_sms(shape)) continue;
    Config c = mk;
    c.fwd_comm_sms = sms;
    c.minibatch_tokens = mb;  // the sweep varies one knob
    v.push_back({"megakernel", at_main_ring(c)});
  }
  for (int64_t m : {std::max<int64_t>(128, mb / 2 / 128 * 128), 2 * mb}) {
    if (m == mb) continue;
    Config c = mk;
    c.minibatch_tokens = m;
    v.push_back({"megakernel", at_main_ring(c)});
  }
  {
    Config c = mk;
    c.combine = CombinePath::Fc2Epilogue;
    c.fwd_comm_sms = o.comm_sms;
    shape_sms(c);
    v.push_back({"megakernel-epilogue-combine", at_main_ring(c)});
  }
  {
    Config c = mk;
    c.dispatch = main.dispatch == DispatchPath::Pull ? DispatchPath::Push : DispatchPath::Pull;
    v.push_back({std::string("megakernel-") + to_string(c.dispatch) + "-dispatch", at_main_ring(c)});
  }
  {
    Config c = mk;
    c.fwd_clusters = !main.fwd_clusters;
    if (c.resolved_fwd_comm_sms(shape) % 2 == 0)
      v.push_back({c.fwd_clusters ? "megakernel-clusters" : "megakernel-no-clusters", at_main_ring(c)});
  }
  {
    Variant inf{"megakernel-inference", mk};
    inf.save_for_backward = false;
    v.push_back(inf);
  }
  {
    Variant zc{"megakernel-x-in-window", mk};
    zc.x_in_window = true;
    v.push_back(zc);
  }
  if (4 * mb < shape.worst_case_rows()) {
    Config c = mk;
    c.minibatch_tokens = mb;
    c.macrobatch_tokens = 4 * mb;
    c.workspace_budget_bytes = 0;  // the ring is this variant's knob
    v.push_back({"megakernel-ring4", c});
  }
  // The main variant with the other backward path, its backward timed: the same-run A/B of the
  // backward's GEMM program against the unfused GEMMs (the same bits: checked like the others).
  const BackwardPath other_bwd = main.backward_path == BackwardPath::Unfused ? BackwardPath::Fused : BackwardPath::Unfused;
  if (o.backward) {
    Variant twin{v.front().name + "-bwd-" + to_string(other_bwd), main};
    twin.cfg.backward_path = other_bwd;
    twin.time_backward = true;
    twin.main_backward_twin = true;
    v.push_back(twin);
  }
  // The main variant's backward with the weight gradients accumulated into fp32 (the unfused bf16
  // backward only: the backward program and FP8 write bf16 gradients).
  if (o.backward && main.backward_path == BackwardPath::Unfused && main.precision == Precision::BF16) {
    Variant acc{v.front().name + "-bwd-accumulate", main};
    acc.time_backward = true;
    acc.accumulate_wgrad = true;
    v.push_back(acc);
  }
  // The training memory model's two modes beside a main variant that has every row resident, their
  // backward timed in the same run (notes/memory.md): one 2 GB workspace shared by the layers and
  // the ring that fits it, with the automatic activation budget (saved) and with none (recompute).
  // Beside a main variant in the training mode (the library's default), the resident one and full
  // recompute instead.
  const bool main_resident = main.macrobatch_tokens == 0 && (main.workspace_budget_bytes == 0 || !main.share_workspace);
  if (!main_resident && o.path == ForwardPath::Megakernel && o.backward && main.macrobatch_tokens == 0 &&
      main.resolved_macrobatch(shape, device_sms()) < shape.worst_case_rows()) {
    Config c = mk;
    c.share_workspace = false;
    c.workspace_budget_bytes = 0;
    Variant resident{"megakernel-resident", c};
    resident.time_backward = true;
    v.push_back(resident);
    if (main.activation_budget_bytes != 0) {
      Variant recompute{"megakernel-training-recompute", at_main_ring(mk)};
      recompute.cfg.activation_budget_bytes = 0;
      recompute.time_backward = true;
      v.push_back(recompute);
    }
  }
  if (main_resident && o.path == ForwardPath::Megakernel && o.backward) {
    Config c = mk;
    c.share_workspace = true;
    c.workspace_budget_bytes = 2000000000;
    int64_t ring = 0;
    try {
      ring = c.resolved_macrobatch(shape, device_sms());
    } catch (const Error& e) {  // even the smallest ring's workspace exceeds the budget at this shape
      std::printf("  (memory-mode variants left out: %s)\n", e.what());
    }
    if (ring > 0 && ring < shape.worst_case_rows()) {
      Variant saved{"megakernel-training-saved", c};
      saved.time_backward = true;
      v.push_back(saved);
      Variant saved_other = saved;
      saved_other.cfg.backward_path = other_bwd;
      saved_other.name += std::string("-bwd-") + to_string(other_bwd);
      v.push_back(saved_other);
      Variant recompute{"megakernel-training-recompute", c};
      recompute.cfg.activation_budget_bytes = 0;
      recompute.time_backward = true;
      v.push_back(recompute);
    }
  }
  // The main variant once more, last: the variants run one after the other while the GPUs heat
  // up towards their power cap, so the first one measured has an edge (up to ~10% in a run of
  // 5db573b). This row shows that drift; compare the variants with it as well as with the first.
  Variant again{v.front().name + "-again", main};
  again.repeat_of_main = true;
  v.push_back(again);
  if (!o.variants.empty()) {  // --variants: the main one, the named ones and the main one again
    for (const auto& want : o.variants)
      if (std::none_of(v.begin(), v.end(), [&](const Variant& x) { return x.name == want; }))
        std::printf("  (--variants: no variant '%s' at this shape)\n", want.c_str());
    std::vector<Variant> kept{v.front()};
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i].repeat_of_main || std::find(o.variants.begin(), o.variants.end(), v[i].name) != o.variants.end())
        kept.push_back(v[i]);
    v = std::move(kept);
  }
  return v;
}

}  // namespace mok::bench
