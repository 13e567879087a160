// gtest parameter names: letters, digits and underscores only.
#pragma once

#include <string>

namespace mok::test {

inline std::string param_name(std::string n) {
  for (auto& c : n)
    if (c == '-') c = '_';
  return n;
}

}  // namespace mok::test
