// mok_bench's GPU mode: the variants it measures at one shape (the main one first, then the
// ablation: one knob each around the main one) and the device's SM count they are resolved with.
#pragma once

#include <string>
#include <vector>

#include "gpu_layer_bench.h"
#include "mok/config.hpp"

namespace mok::bench {

// SMs of GPU 0 (every rank's GPU is one model): the minibatch and ring the layer resolves with.
int device_sms();

struct Variant {
  std::string name;
  Config cfg;
  bool save_for_backward = true;  // false: an inference forward (no gate/up pre-activations kept)
  bool x_in_window = false;       // x written into Layer::input_buffer() once: forward() skips its copy
  bool repeat_of_main = false;    // the main variant measured again, last (shows the thermal drift)
  bool time_backward = false;     // an ablation variant whose backward is timed too (memory modes)
  bool main_backward_twin = false;  // the main variant with the other backward path (JSON: mok_bwd_<path>_ms)
  // Its backward adds the routed weights' gradients into fp32 ones (GradRefs::accumulate, the
  // training stacks' main_grad; JSON: mok_bwd_accumulate_ms).
  bool accumulate_wgrad = false;
};

// Whether the config's layer has a backward: bf16 always; FP8 / MXFP8 on the unfused path and on
// the megakernel with a ring below the worst case (its backward over windows).
bool trains(const Config& cfg, const LayerShape& shape);

// The variants measured at one shape: the main one first. `stands_for` (an EP-S slice run on
// fewer GPUs: the EP-S shape) gives the variants whose comm SMs are chosen from the shape the
// value an EP-S rank would choose (the rule for one GPU differs).
std::vector<Variant> variants_for(const GpuBenchOptions& o, const LayerShape& shape,
                                  const LayerShape* stands_for = nullptr);

}  // namespace mok::bench
