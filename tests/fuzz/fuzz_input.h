#pragma once
// What every fuzz target shares: the fuzz input as a file without touching the disk, and the
// rule for exceptions.
//
// A flux8::Error is the expected answer to a bad input and is caught. Anything else reaching
// the target crashes the fuzzer and counts as a finding: a library exception that escaped the
// input boundary (std::length_error, nlohmann::json::exception, YAML::Exception, std::bad_alloc),
// a sanitizer report, a timeout, or an allocation above -malloc_limit_mb. An Error from
// FLUX8_CHECK is a finding too: it reports a broken invariant, not a bad input.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "core/error.h"

namespace flux8::fuzz {

// An anonymous in-memory file (memfd) whose path, /proc/self/fd/N, the file-reading APIs
// accept like any regular file. One per process, rewritten for each input: no disk I/O per
// execution.
class MemFile {
 public:
  explicit MemFile(const char* name) {
    fd_ = memfd_create(name, MFD_CLOEXEC);
    if (fd_ < 0) die("memfd_create", name);
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  ~MemFile() { close(fd_); }

  const std::string& path() const { return path_; }

  // Replaces the contents with `size` bytes of `data`.
  void assign(const void* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) die("ftruncate", path_.c_str());
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t n = pwrite(fd_, p + done, size - done, static_cast<off_t>(done));
      if (n <= 0) die("pwrite", path_.c_str());
      done += static_cast<size_t>(n);
    }
  }
  void assign(std::string_view text) { assign(text.data(), text.size()); }

 private:
  [[noreturn]] static void die(const char* call, const char* what) {
    std::fprintf(stderr, "fuzz harness: %s(%s) failed: %s\n", call, what, std::strerror(errno));
    std::abort();
  }
  int fd_ = -1;
  std::string path_;
};

// Runs `parse` on one input: a flux8::Error is the expected outcome of a bad input, except an
// internal check failure, which aborts with its message like any other escaped exception.
template <typename F>
void expect_only_input_errors(F&& parse) {
  try {
    parse();
  } catch (const flux8::Error& e) {
    if (std::string_view(e.what()).starts_with("internal check failed")) {
      std::fprintf(stderr, "finding: a bad input broke an internal invariant: %s\n", e.what());
      std::abort();
    }
  }
}

}  // namespace flux8::fuzz
