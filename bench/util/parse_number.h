// mok's benchmarks: one strict parser for numeric command-line values (mok_bench's options and
// the GEMM benchmarks'), so that a bad value is an error naming the option, never a silent 0.
#pragma once

#include <charconv>
#include <string>
#include <system_error>
#include <type_traits>

#include "mok/errors.hpp"

namespace mok::bench {

// `text` as a T: the whole string must be a number (no sign '+', spaces, fraction for integers,
// or trailing characters) within [lo, hi]; otherwise a mok::Error naming `option`, e.g.
// "mok: invalid argument '--ranks' (got 'abc'): must be a whole number in [1, 4096]".
// `hint` (e.g. " (0 = all cores)") is appended to the constraint.
template <typename T>
T parse_number(const std::string& option, const std::string& text, T lo, T hi, const char* hint = "") {
  static_assert(std::is_arithmetic_v<T>);
  T v{};
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, v);
  // Written as !(in range) so that NaN (from "nan") fails too.
  if (text.empty() || ec != std::errc() || stop != end || !(v >= lo && v <= hi)) {
    throw Error(ErrorKind::InvalidArgument, option,
                detail::concat("must be ", std::is_integral_v<T> ? "a whole number" : "a number", " in [",
                               lo, ", ", hi, "]", hint),
                "got '" + text + "'");
  }
  return v;
}

}  // namespace mok::bench
