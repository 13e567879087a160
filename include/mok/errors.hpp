// mok — error type shared by the whole library.
//
// Every error raised for bad input names the argument and the constraint it violated, so that a
// user who passes a wrong tensor sees "topk_idx[3,1] = 300: expert ids must satisfy -1 <= id < E
// (E = 256)" rather than a crash or a silently wrong result.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mok {

enum class ErrorKind {
  InvalidArgument,  // a user input violates a documented constraint
  Unsupported,      // valid request, not implemented for this configuration/device
  Runtime,          // CUDA / NCCL / system failure
  Timeout,          // a bounded device-side wait expired
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string argument, std::string constraint, std::string detail = {})
      : std::runtime_error(format(kind, argument, constraint, detail)),
        kind_(kind),
        argument_(std::move(argument)),
        constraint_(std::move(constraint)) {}

  ErrorKind kind() const noexcept { return kind_; }
  // The argument (or wait, or call) at fault, e.g. "topk_idx" or "config.minibatch_tokens".
  const std::string& argument() const noexcept { return argument_; }
  // The violated constraint, e.g. "-1 <= id < E (E = 256)".
  const std::string& constraint() const noexcept { return constraint_; }

 private:
  static std::string format(ErrorKind kind, const std::string& argument,
                            const std::string& constraint, const std::string& detail) {
    std::ostringstream s;
    switch (kind) {
      case ErrorKind::InvalidArgument: s << "mok: invalid argument '"; break;
      case ErrorKind::Unsupported: s << "mok: unsupported '"; break;
      case ErrorKind::Runtime: s << "mok: runtime failure in '"; break;
      case ErrorKind::Timeout: s << "mok: timeout in '"; break;
    }
    s << argument << "'";
    if (!detail.empty()) s << " (" << detail << ")";
    s << ": " << constraint;
    return s.str();
  }

  ErrorKind kind_;
  std::string argument_;
  std::string constraint_;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
}  // namespace detail

// Throws an InvalidArgument error unless `cond` holds. The constraint is built from the trailing
// parts only when the check fails.
#define MOK_REQUIRE(cond, argument, ...)                                                       \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      throw ::mok::Error(::mok::ErrorKind::InvalidArgument, (argument),                        \
                         ::mok::detail::concat(__VA_ARGS__));                                  \
    }                                                                                          \
  } while (0)

}  // namespace mok
