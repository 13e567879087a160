// mok — an A/B knob from the environment: NAME=0 or NAME=1, else `fallback` when unset; any
// other value is refused by name (the layer's MOK_BWD_* knobs, read when a layer is built or its
// first backward runs).
#pragma once

#include <cstdlib>
#include <string>

#include "mok/errors.hpp"

namespace mok {

inline bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  const std::string o = v;
  MOK_REQUIRE(o == "0" || o == "1", name, "must be 0 or 1, got '", o, "'");
  return o == "1";
}

}  // namespace mok
