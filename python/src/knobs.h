// mok.MoE's config knobs by name, shared by mok._cpu (the memory planner) and mok._cuda (the GPU
// layer), so both read the same mok::Config from the same keyword arguments.
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <string>

#include "mok/config.hpp"
#include "mok/errors.hpp"

namespace mok::python {

// Config::precision by its name (bf16, fp8, mxfp8). The layer and the engine refuse what they do
// not run by name (the GPU layer's backward: bf16, and fp8 / mxfp8 on the unfused path).
inline mok::Precision precision_named(const std::string& v) {
  for (const mok::Precision p : {mok::Precision::BF16, mok::Precision::FP8, mok::Precision::MXFP8})
    if (v == mok::to_string(p)) return p;
  MOK_REQUIRE(false, "config.precision", "must be 'bf16', 'fp8' or 'mxfp8', got '", v, "'");
  return mok::Precision::BF16;
}

// mok.MoE's config knobs (their names are mok::Config's, their values given as text) into `c`;
// an unknown name or value is a mok.Error naming it. cpu_threads is the CPU engine's.
inline void apply_knobs(mok::Config& c, const std::map<std::string, std::string>& knobs) {
  const auto number = [](const std::string& name, const std::string& v) {
    size_t used = 0;
    long long n = 0;
    try {
      n = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOK_REQUIRE(used == v.size() && !v.empty(), "config." + name, "must be a whole number, got '", v, "'");
    return static_cast<int64_t>(n);
  };
  const auto pick = [](const std::string& name, const std::string& v, auto a, auto b) {
    if (v == mok::to_string(a)) return a;
    MOK_REQUIRE(v == mok::to_string(b), "config." + name, "must be '", mok::to_string(a), "' or '", mok::to_string(b),
                "', got '", v, "'");
    return b;
  };
  for (const auto& [name, v] : knobs) {
    if (name == "forward_path") {
      c.forward_path = pick(name, v, mok::ForwardPath::Megakernel, mok::ForwardPath::Unfused);
    } else if (name == "combine") {
      c.combine = pick(name, v, mok::CombinePath::CommCtas, mok::CombinePath::Fc2Epilogue);
    } else if (name == "dispatch") {
      c.dispatch = pick(name, v, mok::DispatchPath::Pull, mok::DispatchPath::Push);
    } else if (name == "backward_path") {
      c.backward_path = pick(name, v, mok::BackwardPath::Unfused, mok::BackwardPath::Fused);
    } else if (name == "fwd_clusters") {
      c.fwd_clusters = number(name, v) != 0;
    } else if (name == "fwd_comm_sms") {
      c.fwd_comm_sms = static_cast<int>(number(name, v));
    } else if (name == "bwd_comm_sms") {
      c.bwd_comm_sms = static_cast<int>(number(name, v));
    } else if (name == "minibatch_tokens") {
      c.minibatch_tokens = number(name, v);
    } else if (name == "macrobatch_tokens") {
      c.macrobatch_tokens = number(name, v);
    } else if (name == "activation_budget_bytes") {
      c.activation_budget_bytes = number(name, v);
    } else if (name == "share_workspace") {
      c.share_workspace = number(name, v) != 0;
    } else if (name == "workspace_budget_bytes") {
      c.workspace_budget_bytes = number(name, v);
    } else if (name == "fp8_keep_weight_codes_t") {
      c.fp8_keep_weight_codes_t = number(name, v) != 0;
    } else if (name == "saved_forwards") {
      c.saved_forwards = static_cast<int>(number(name, v));
    } else if (name == "precision") {
      c.precision = precision_named(v);
    } else if (name == "wait_timeout_s") {
      try {
        c.wait_timeout_s = std::stod(v);
      } catch (const std::exception&) {
        MOK_REQUIRE(false, "config.wait_timeout_s", "must be a number of seconds, got '", v, "'");
      }
    } else {
      MOK_REQUIRE(name == "cpu_threads", "config", "no knob named '", name, "'");
    }
  }
}

}  // namespace mok::python
