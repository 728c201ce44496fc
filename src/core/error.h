#pragma once
// Errors in flux8 are exceptions carrying a message that says what was wrong, where
// (file, key, tensor, step) and what to do. They are caught once, in main(), which turns their
// kind into the process's exit status (`flux8 --help` lists them), so that a scheduler can tell
// a bad config from bad data, a device that ran out of memory or a run that diverged.
#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace flux8 {

enum class ErrorKind : uint8_t {
  general,        // anything not below (I/O, a checkpoint, a collective, ...)
  config,         // the config or the command line asks for something impossible
  data,           // shards, validation set or empty prompt missing, unreadable or malformed
  out_of_memory,  // a device or host allocation failed
  nonfinite,      // training stopped on non-finite losses or gradients (nan_policy)
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, ErrorKind kind = ErrorKind::general)
      : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// An allocation the device (or host) could not satisfy, with the sizes it reported, so that
// the code that catches it can say which settings would fit (0: not known).
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& what, uint64_t requested_bytes, uint64_t free_bytes, uint64_t total_bytes)
      : Error(what, ErrorKind::out_of_memory), requested(requested_bytes), free(free_bytes), total(total_bytes) {}
  uint64_t requested, free, total;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...), kind);
}

// Runs `f`; an Error of no particular kind that it throws is rethrown as one of `kind`. The
// phase an error comes from says what it is about: everything that fails while a config is read
// and checked is a config error, whichever layer's check it was.
template <typename F>
decltype(auto) with_error_kind(ErrorKind kind, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::general) throw;
    throw Error(e.what(), kind);
  }
}

}  // namespace flux8

// Internal invariant check: a failure here is a flux8 bug, not a user error.
#define FLUX8_CHECK(cond, ...)                                                                                         \
  do {                                                                                                                 \
    if (!(cond))                                                                                                       \
      ::flux8::fail("internal check failed at {}:{}: {} ({})", __FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (0)
