#pragma once
// Errors in flux8 are exceptions carrying a message that says what was wrong, where
// (file, key, tensor, step) and what to do. They are caught once, in main().
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace flux8 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace flux8

// Internal invariant check: a failure here is a flux8 bug, not a user error.
#define FLUX8_CHECK(cond, ...)                                                                                         \
  do {                                                                                                                 \
    if (!(cond))                                                                                                       \
      ::flux8::fail("internal check failed at {}:{}: {} ({})", __FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (0)
